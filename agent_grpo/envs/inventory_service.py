"""The small JSON inventory service behind WebApi-v0, served by stdlib `http.server` in a thread.

Endpoints (all JSON):

    GET  /items                 -> 200 [{"id", "name", "stock"}, ...]
    GET  /items/<id>            -> 200 item | 404
    POST /items/<id>/restock    {"quantity": n > 0}            -> 200 item | 400 | 404
    GET  /orders                -> 200 [{"id", "item_id", "quantity"}, ...]
    POST /orders                {"item_id": id, "quantity": n > 0} -> 201 order | 400 | 404 | 409

State lives in an `Inventory` shared with the environment, which loads each task's initial
state and reads the final state to verify. `ServiceThread.stop()` shuts the server down, closes
its socket and joins every request thread (`ThreadingHTTPServer` with `block_on_close`), so
nothing leaks.
"""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from pydantic import BaseModel, ConfigDict

__all__ = ["Inventory", "InventoryState", "Item", "Order", "ServiceThread"]


class _Value(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class Item(_Value):
    """A product in stock."""

    id: int
    """Item id used in paths."""
    name: str
    """Product name, e.g. `blue lamp`."""
    stock: int
    """Units in stock."""


class Order(_Value):
    """A placed order."""

    id: int
    """Order id (1, 2, ...)."""
    item_id: int
    """Ordered item."""
    quantity: int
    """Units ordered."""


class InventoryState(_Value):
    """The whole service state; two states are equal iff the service looks the same."""

    items: list[Item]
    """Items by ascending id."""
    orders: list[Order] = []
    """Orders in the order they were placed."""


class ApiError(Exception):
    """An HTTP error response: status and message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _quantity(body: Any) -> int:
    value = body.get("quantity") if isinstance(body, dict) else None
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ApiError(400, 'body needs "quantity": a positive integer')
    return value


class Inventory:
    """Thread-safe service state and the logic of each endpoint."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state = InventoryState(items=[])

    def load(self, state: InventoryState) -> None:
        """Replace the whole state (a new episode)."""
        with self._lock:
            self._state = state.model_copy(deep=True)

    def snapshot(self) -> InventoryState:
        """A copy of the current state."""
        with self._lock:
            return self._state.model_copy(deep=True)

    def _item(self, item_id: int) -> Item:
        item = next((i for i in self._state.items if i.id == item_id), None)
        if item is None:
            raise ApiError(404, f"no item with id {item_id}")
        return item

    def handle(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        """Serve one request: returns (status, JSON-able body); errors become {"error": ...}."""
        try:
            with self._lock:
                return self._route(method, path.rstrip("/") or "/", body)
        except ApiError as error:
            return error.status, {"error": str(error)}

    def _route(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        if (method, path) == ("GET", "/items"):
            return 200, [i.model_dump() for i in self._state.items]
        if (method, path) == ("GET", "/orders"):
            return 200, [o.model_dump() for o in self._state.orders]
        if (method, path) == ("POST", "/orders"):
            return 201, self._order(body).model_dump()
        if method == "GET" and (match := re.fullmatch(r"/items/(\d+)", path)):
            return 200, self._item(int(match[1])).model_dump()
        if method == "POST" and (match := re.fullmatch(r"/items/(\d+)/restock", path)):
            item = self._item(int(match[1]))
            item.stock += _quantity(body)
            return 200, item.model_dump()
        raise ApiError(404, f"no endpoint {method} {path}; see the API list in the instructions")

    def _order(self, body: Any) -> Order:
        item_id = body.get("item_id") if isinstance(body, dict) else None
        if not isinstance(item_id, int) or isinstance(item_id, bool):
            raise ApiError(400, 'body needs "item_id": an integer item id')
        item, quantity = self._item(item_id), _quantity(body)
        if quantity > item.stock:
            raise ApiError(409, f"only {item.stock} units of {item.name} in stock")
        item.stock -= quantity
        order = Order(id=len(self._state.orders) + 1, item_id=item_id, quantity=quantity)
        self._state.orders.append(order)
        return order


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def _serve(self, method: str) -> None:
        body: Any = None
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            try:
                body = json.loads(self.rfile.read(length))
            except ValueError:
                self._send(400, {"error": "body is not valid JSON"})
                return
        self._send(*self.server.inventory.handle(method, self.path, body))

    def _send(self, status: int, payload: Any) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def log_message(self, format: str, *args: Any) -> None:
        """Silence the per-request stderr log."""


class _Server(ThreadingHTTPServer):
    # Request threads are tracked and joined by server_close(), so stop() leaves none behind.
    daemon_threads = False
    block_on_close = True

    def __init__(self, inventory: Inventory) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.inventory = inventory


class ServiceThread:
    """The service listening on 127.0.0.1 on a free port, served from a background thread."""

    def __init__(self, inventory: Inventory) -> None:
        self._server = _Server(inventory)
        host, port = self._server.server_address[:2]
        self.url = f"http://{host!s}:{port}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Shut down, close the socket and join every thread (idempotent)."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join()
        self._server.server_close()
