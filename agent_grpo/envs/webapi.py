"""WebApi-v0: operate a small inventory HTTP service; the verifier checks the service's state.

Tasks name items by name, so every task needs a lookup (`GET /items`) before the action (an order
or a restock) or the answer (a stock count). Success means the final state equals the state the
task asks for: doing the right thing twice, or also touching another item, fails. The service
starts on 127.0.0.1 on a free port at the first `reset()` and stops at `close()`.
"""

from __future__ import annotations

import json
import weakref
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict

from agent_grpo.envs.answers import number_verdict
from agent_grpo.envs.inventory_service import Inventory, InventoryState, Item, Order, ServiceThread
from agent_grpo.envs.text_env import ToolEnv, Verdict
from agent_grpo.tools.http import make_http_tools

__all__ = ["InventoryTask", "WebApiEnv", "expected_state"]

_COLOURS = ["red", "blue", "green", "black", "white", "yellow", "grey", "orange"]
_THINGS = ["lamp", "chair", "kettle", "desk", "rug", "clock", "mug", "shelf", "vase", "stool"]
_NAMES = [f"{colour} {thing}" for colour in _COLOURS for thing in _THINGS]
Kind = Literal["order", "restock", "count"]
_KINDS: list[Kind] = ["order", "restock", "count"]


class InventoryTask(BaseModel):
    """One inventory task and the initial service state."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    kind: Kind
    """order: order `quantity` units; restock: bring stock to `quantity`; count: report stock."""
    item: str
    """Name of the item the task is about."""
    quantity: int
    """Units to order, or target stock (unused for count)."""
    initial: InventoryState
    """The service state at the start."""


def expected_state(task: InventoryTask) -> InventoryState:
    """The state the task asks for."""
    state = task.initial.model_copy(deep=True)
    item = next(i for i in state.items if i.name == task.item)
    if task.kind == "order":
        item.stock -= task.quantity
        state.orders.append(
            Order(id=len(state.orders) + 1, item_id=item.id, quantity=task.quantity)
        )
    elif task.kind == "restock":
        item.stock = task.quantity
    return state


def _prompt(task: InventoryTask) -> str:
    if task.kind == "order":
        return f"Order {task.quantity} units of {task.item}."
    if task.kind == "restock":
        return f"Restock {task.item} so that exactly {task.quantity} units are in stock."
    return f"How many units of {task.item} are in stock?"


class WebApiEnv(ToolEnv[InventoryTask]):
    """Order, restock or count items through the inventory API with http_get and http_post."""

    reusable = True  # reset loads the task's whole inventory into the running service

    system_prompt = (
        "You manage a shop through its JSON API:\n"
        "GET /items lists items (id, name, stock)\n"
        'POST /items/<id>/restock {"quantity": n} adds n units\n'
        'POST /orders {"item_id": id, "quantity": n} orders n units\n'
        "Use http_get and http_post. When finished, reply with: Answer: <number asked for, or done>"
    )
    default_max_turns = 5

    def __init__(self, num_items: int = 5, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.num_items = num_items
        self.inventory = Inventory()
        self._service: ServiceThread | None = None
        self.tools = make_http_tools(lambda: self.service_url)

    @property
    def service_url(self) -> str:
        """Base URL of the running service (started by the first reset)."""
        if self._service is None:
            raise RuntimeError("the service starts at the first reset()")
        return self._service.url

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[dict[str, str]], dict[str, Any]]:
        """Start the service if needed and load the task's initial state."""
        if self._service is None:
            self._service = ServiceThread(self.inventory)
            # Stops the server even if the env is dropped without close().
            self._finalizer = weakref.finalize(self, self._service.stop)
        messages, info = super().reset(seed=seed, options=options)
        assert self.task is not None
        self.inventory.load(self.task.initial)
        return messages, info

    def close(self) -> None:
        """Stop the service: socket closed, threads joined."""
        if self._service is not None:
            self._finalizer()
            self._service = None

    def generate_task(self, rng: np.random.Generator) -> InventoryTask:
        """Random items and stock levels, and a task about one of them."""
        picked = rng.choice(len(_NAMES), size=self.num_items, replace=False)
        ids = np.sort(rng.choice(np.arange(1, 1000), size=self.num_items, replace=False))
        items = [
            Item(id=int(i), name=_NAMES[int(n)], stock=int(rng.integers(0, 40)))
            for i, n in zip(ids, picked, strict=True)
        ]
        target = items[int(rng.integers(len(items)))]
        kind = _KINDS[int(rng.integers(len(_KINDS)))]
        if kind == "order" and target.stock == 0:
            kind = "restock"
        if kind == "order":
            quantity = int(rng.integers(1, target.stock + 1))
        elif kind == "restock":
            quantity = target.stock + int(rng.integers(1, 30))
        else:
            quantity = 0
        initial = InventoryState(items=items)
        return InventoryTask(kind=kind, item=target.name, quantity=quantity, initial=initial)

    def user_prompt(self, task: InventoryTask) -> str:
        """The request."""
        return _prompt(task)

    def verify(self, task: InventoryTask, answer: str) -> Verdict:
        """The final service state must equal the requested one (and a count must be right)."""
        final, wanted = self.inventory.snapshot(), expected_state(task)
        if final != wanted:
            return Verdict(
                success=False,
                expected=wanted.model_dump_json(),
                given=final.model_dump_json(),
                detail="service state differs from the requested state",
            )
        if task.kind == "count":
            item = next(i for i in wanted.items if i.name == task.item)
            return number_verdict(answer, item.stock)
        return Verdict(success=True, expected="state", given=answer)

    def expert_action(self) -> str:
        """List the items, act on the named one by its id, then answer."""
        assert self.task is not None
        done = [c for c in self.tool_calls if c.error is None]
        if not done:
            return self.call("http_get", path="/items")
        # The listing the expert acts on is the one it got back, not the task's hidden state.
        listing = json.loads((done[0].result or "0 []").split(" ", 1)[1])
        item = next(i for i in listing if i["name"] == self.task.item)
        if self.task.kind == "count":
            return f"Answer: {item['stock']}"
        if len(done) >= 2:
            return "Answer: done"
        if self.task.kind == "order":
            body = {"item_id": item["id"], "quantity": self.task.quantity}
            return self.call("http_post", path="/orders", body=body)
        body = {"quantity": self.task.quantity - item["stock"]}
        return self.call("http_post", path=f"/items/{item['id']}/restock", body=body)
