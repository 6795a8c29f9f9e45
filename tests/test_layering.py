"""The layering rule (docs/architecture.md, "Layers and ports"): a room imports only
rooms below it, and lower rooms name upper ones through small `typing.Protocol`
ports (server/ports.py), never by importing the concrete class.

Every import counts: at the top of a module, inside a function, and under
`if TYPE_CHECKING:` (a type-level import up is still a circle of names)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import amqpbroker

PACKAGE = Path(amqpbroker.__file__).parent

# Ranks from the ground up: a room may import its own modules and rooms of a lower
# rank only.  A package under amqpbroker/ is a room; the modules directly under it
# belong to the rooms MODULE_ROOMS names.
RANKS = {
    "amqpbroker": 0,                           # the package: product name and version
    "core": 0, "looptrace": 0,                 # pure decisions; the loop's timeline
    "config": 1, "store": 1,                   # beside core
    "security": 2,
    "management": 3,                           # depends on core, security, config, store ports
    "server": 4,
    "ha": 5, "testing": 5, "spark": 5,
    "cluster": 6,                              # beside ha/, above server/; a node may be an HA pair
    "commands": 7,                             # the roof
}
MODULE_ROOMS = {"config_help": "config", "cli": "commands", "client_cli": "commands",
                "config_tool": "commands", "config_reference": "commands"}

# Imports up that remain, each with its reason (module, imported module): none now
# (the configuration's DN and duration parsing moved to core/dn.py and
# core/durations.py); an entry here is a known step still to take.
KNOWN_UPWARD: dict[tuple[str, str], str] = {}

# Within server/: the composition points that may import the connection handler
# (handlers.py) or the server (app.py), and why.  Every other server module names
# them through server/ports.py.
COMPOSITION_POINTS = {
    ("amqpbroker.server.app", "amqpbroker.server.handlers"):
        "BrokerServer.make_handler: the handler each connection's engine builds",
}
UPPER_SERVER_MODULES = {"amqpbroker.server.handlers", "amqpbroker.server.app"}

# Within management/: service.py (`Operations`) builds the authenticator, the metrics
# and the API; they name it through management/port.py.  What still imports it (none
# since uvicorn on the broker's loop moved to management/http_server.py):
MANAGEMENT_SERVICE_IMPORTS: dict[tuple[str, str], str] = {}

# Rooms whose modules import each other without a circle (type-level ones included).
ACYCLIC_ROOMS = ("core", "server", "store", "cluster", "management", "ha", "security", "spark")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, name: str | None = None) -> set[str]:
    """Every amqpbroker module a file (module `name`) imports, anywhere in it
    (TYPE_CHECKING blocks and function bodies too), relative imports resolved;
    `from x import y` counts both x and x.y (y may be a module)."""
    here = (name or module_name(path)).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            out.add(module)
            out.update(f"{module}.{alias.name}" for alias in node.names)
    return {m for m in out if m.split(".")[0] == "amqpbroker" and is_module(m)}


def is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def room(name: str) -> str:
    parts = name.split(".")
    first = parts[1] if len(parts) > 1 else parts[0]
    return MODULE_ROOMS.get(first, first)


def all_imports() -> dict[str, set[str]]:
    return {module_name(p): imported_modules(p) for p in sorted(PACKAGE.rglob("*.py"))}


def upward_imports(imports: dict[str, set[str]]) -> set[tuple[str, str]]:
    found = set()
    for module, targets in imports.items():
        for target in targets:
            if room(module) != room(target) and RANKS[room(target)] >= RANKS[room(module)]:
                found.add((module, target))
    return found


def test_every_room_has_a_rank():
    rooms = {room(m) for m in all_imports()}
    assert rooms - set(RANKS) == set(), "a new room: give it its place in RANKS"
    assert len(rooms) >= 10


def test_rooms_import_only_rooms_below_them():
    assert upward_imports(all_imports()) - set(KNOWN_UPWARD) == set()


def test_known_upward_imports_are_still_there():
    """An exception that no longer happens is removed from the list, so the list
    stays the set of steps still to take."""
    assert set(KNOWN_UPWARD) - upward_imports(all_imports()) == set()


def test_core_imports_no_other_room():
    core = {m: t for m, t in all_imports().items() if room(m) == "core"}
    assert len(core) >= 30
    assert {m: sorted(x for x in t if room(x) != "core") for m, t in core.items()
            if any(room(x) != "core" for x in t)} == {}


def test_server_modules_name_the_handler_and_the_server_through_ports():
    imports = all_imports()
    reaching_up = {(m, t) for m, t_all in imports.items() if m.startswith("amqpbroker.server.")
                   for t in t_all & UPPER_SERVER_MODULES if t != m}
    assert reaching_up - set(COMPOSITION_POINTS) == set()
    assert set(COMPOSITION_POINTS) <= reaching_up, "a composition point listed that is none"


def test_management_modules_name_the_operations_through_ports():
    imports = all_imports()
    service = "amqpbroker.management.service"
    importing = {(m, service) for m, t in imports.items()
                 if service in t and m != service and room(m) == "management"}
    assert importing == set(MANAGEMENT_SERVICE_IMPORTS)


def import_circles(imports: dict[str, set[str]], room_name: str) -> list[list[str]]:
    """Strongly connected sets of more than one module inside a room (a package and
    the submodules it gathers excepted: `selectors` and `selectors.compiler`)."""
    modules = {m for m in imports if room(m) == room_name}
    graph = {m: {t for t in imports[m] if t in modules and t != m and not t.startswith(m + ".")
                 and not m.startswith(t + ".")} for m in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:   # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                circles.append(sorted(part))

    for v in sorted(modules):
        if v not in index:
            visit(v)
    return circles


@pytest.mark.parametrize("room_name", ACYCLIC_ROOMS)
def test_no_import_circles_inside_the_room(room_name):
    assert import_circles(all_imports(), room_name) == []


def test_the_circle_check_can_fail():
    imports = {"amqpbroker.core.a": {"amqpbroker.core.b"}, "amqpbroker.core.b": {"amqpbroker.core.a"},
               "amqpbroker.core.c": {"amqpbroker.core.a"}}
    assert import_circles(imports, "core") == [["amqpbroker.core.a", "amqpbroker.core.b"]]


def test_the_import_check_sees_type_checking_and_lazy_imports(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .handlers import X\n"
                      "def f():\n    from ..cli import main\n")
    found = imported_modules(sample, "amqpbroker.server._layering_sample")
    assert {"amqpbroker.server.handlers", "amqpbroker.cli"} <= found
    assert {("amqpbroker.server._layering_sample", "amqpbroker.cli")} == \
        upward_imports({"amqpbroker.server._layering_sample": found})
