"""Calls go down the floors, never up (docs/architecture.md, "The tree"): every import in
`agent_grpo/`, at module level or inside a function, and every module named by string (an entry
point `module:Name`, a lazily imported module), goes to a lower floor or stays in its own unit.

`FLOORS` is the declared order. A unit is a module or package; a module belongs to the unit with
the longest matching name. Units on one floor are peers and do not import each other. The parts'
configs sit below the job configs that assemble them (`config/jobs.py`), and those below the code
that runs a step, so any floor may take a config without importing the code that runs it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "agent_grpo"

FLOORS: list[tuple[str, ...]] = [
    ("agent_grpo.controls",),
    ("agent_grpo.logs", "agent_grpo.faults", "agent_grpo._moved", "agent_grpo.config.base"),
    ("agent_grpo.tools.formats",),
    ("agent_grpo.trajectory",),
    ("agent_grpo.run_dir", "agent_grpo.sandbox"),
    ("agent_grpo.tools",),
    ("agent_grpo.envs", "agent_grpo.algo", "agent_grpo.rewards"),
    ("agent_grpo.models",),
    ("agent_grpo.rollout.backends.base", "agent_grpo.rollout.context"),
    ("agent_grpo.rollout.config",),
    ("agent_grpo.config",),
    ("agent_grpo.rollout",),
    ("agent_grpo.preflight",),
    ("agent_grpo.evaluation",),
    ("agent_grpo.trainer",),
    ("agent_grpo.inspect", "agent_grpo.export"),
    ("agent_grpo.api", "agent_grpo.cli"),
    ("agent_grpo",),
    ("agent_grpo.testing",),
]
"""Units from the ground up: a unit may import its own modules and those of lower floors."""


def module_name(path: Path) -> str:
    """`agent_grpo/x/y.py` -> `agent_grpo.x.y`; a package's `__init__.py` is the package."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def unit_of(module: str) -> tuple[int, str]:
    """The floor and unit a module belongs to: the longest unit name it is or lies under."""
    found = [
        (len(unit), floor, unit)
        for floor, units in enumerate(FLOORS)
        for unit in units
        if module == unit or module.startswith(unit + ".")
    ]
    assert found, f"{module} is on no floor: add it to FLOORS"
    _, floor, unit = max(found)
    return floor, unit


def _target(name: str) -> str | None:
    """The module an imported name refers to: itself, or the module holding it."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _is_call_to(node: ast.AST, function: str) -> bool:
    return isinstance(node, ast.Call) and (
        (isinstance(node.func, ast.Name) and node.func.id == function)
        or (isinstance(node.func, ast.Attribute) and node.func.attr == function)
    )


def _messages(tree: ast.AST) -> set[int]:
    """Ids of the strings that only name a new home in an error message (`moved_names`)."""
    return {
        id(c)
        for node in ast.walk(tree)
        if _is_call_to(node, "moved_names")
        for c in ast.walk(node)
        if isinstance(c, ast.Constant)
    }


def imports(module: str) -> Iterator[tuple[int, str]]:
    """(line, module) of every agent_grpo module `module` imports or names by string."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    skip = _messages(tree) if module != "agent_grpo._moved" else None
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *([node.module] if node.module else [])])
            names = [f"{base}.{alias.name}" for alias in node.names]
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and skip is not None
            and id(node) not in skip
        ):
            name = node.value.partition(":")[0]  # a dotted module, or an entry point's
            if "." in name and name in MODULES and (":" in node.value or name == node.value):
                names = [name]
        for name in names:
            target = _target(name) if name.startswith("agent_grpo") else None
            if target is not None:
                yield node.lineno, target


def upward_imports(module: str) -> list[str]:
    """`module`'s imports that do not go down the floors, one line each."""
    floor, unit = unit_of(module)
    bad = []
    for line, target in imports(module):
        to_floor, to_unit = unit_of(target)
        if to_unit != unit and to_floor >= floor:
            bad.append(f"{module}, line {line}: {unit} (floor {floor}) imports {target} "
                       f"({to_unit}, floor {to_floor})")  # fmt: skip
    return bad


@pytest.mark.parametrize("module", sorted(MODULES))
def test_every_import_goes_down_the_floors(module: str) -> None:
    assert upward_imports(module) == []


def test_the_floors_name_every_unit_once() -> None:
    units = [unit for floor in FLOORS for unit in floor]
    assert len(units) == len(set(units))
    assert all(unit in MODULES for unit in units)


def test_an_upward_import_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The check itself can fail: the same rules over a copy of a module with one import added.
    source = MODULES["agent_grpo.algo.grpo"]
    fake = tmp_path / "grpo.py"
    fake.write_text(
        source.read_text() + "\n\ndef _late() -> None:\n    from agent_grpo.trainer import loop\n"
    )
    monkeypatch.setitem(MODULES, "agent_grpo.algo.grpo", fake)
    (bad,) = upward_imports("agent_grpo.algo.grpo")
    assert "imports agent_grpo.trainer.loop (agent_grpo.trainer, floor 14)" in bad
