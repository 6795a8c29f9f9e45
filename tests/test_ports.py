"""The ports hold (docs/architecture.md, "Layers and ports"): a room names an upper one
only through a small `typing.Protocol`, so nothing but this test ties a port to the
class that stands behind it at run time.  For each port and each of its
implementations: every method the port declares exists with a signature that accepts
every call the port allows (the same parameters in the same places, more only with
defaults; positional ones by position, as the callers pass them), and every
attribute it declares is set somewhere in the class (an assignment to `self.<name>`,
a class attribute, a property or a dataclass field).

Every Protocol in the package is listed here with its implementations, so a new port
is not left out silently."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import textwrap
import typing

import pytest

import amqpbroker

A = "amqpbroker."
IMPLEMENTATIONS = {
    "core.entries.ConsumerPort": ["cluster.shovel.ShovelLink", "cluster.moves.MoveLink", "server.links.LinkConsumer"],
    "core.entries.StoreHooks": ["store.durability.DurabilityManager"],
    "core.ordering.Owner": ["server.producers.Producer"],
    "store.topiclog.LogOwner": ["store.durability.DurabilityManager"],
    "ha.node.LiveCompanion": ["cluster.pair.PairCompanion"],
    "management.port.ListenerInfo": ["server.app.Listener"],
    "management.port.ConnectionSocket": ["server.engine.AmqpProtocol"],
    "management.port.ManagedConnection": ["server.handlers.ConnectionHandler"],
    "management.port.ManagedStore": ["store.lmdb_store.LmdbStore"],
    "management.port.UserDirectory": ["security.users.UserStore"],
    "management.port.ManagedBroker": ["server.app.BrokerServer"],
    "management.port.AuthOperations": ["management.service.Operations"],
    "management.port.MetricsOperations": ["management.service.Operations"],
    "management.port.MessageOperations": ["management.service.Operations"],
    "management.port.ApiOperations": ["management.service.Operations"],
    "server.ports.ConnectionIO": ["server.engine.AmqpProtocol"],
    "server.ports.LinkServices": ["server.app.BrokerServer"],
    "server.ports.LinkOwner": ["server.handlers.ConnectionHandler"],
    "server.ports.ProducerOwner": ["server.handlers.ConnectionHandler"],
    "server.ports.ConsumerOwner": ["server.handlers.ConnectionHandler"],
    "server.ports.AttachOwner": ["server.handlers.ConnectionHandler"],
    "server.ports.AttachContext": ["server.attach.ConsumerAttacher"],
    "server.ports.ConnectionEvents": ["server.handlers.ConnectionHandler"],
    "server.ports.ListenerSpec": ["server.app.Listener"],
    "server.ports.ConnectionServer": ["server.app.BrokerServer"],
    "server.ports.ReloadTarget": ["server.app.BrokerServer"],
    "server.ports.ForwardedEndpoint": [
        "cluster.forward.ForwardedConsumer", "cluster.forward.ForwardedProducer", "cluster.guard.LocalAttach",
        "cluster.guard.LookupAnswer", "cluster.keyless.KeylessProducer", "cluster.lookup.LookupConsumer",
        "cluster.partitioned.FanInConsumer", "cluster.partitioned.PartitionedProducer"],
    "server.ports.ClusterPort": ["cluster.router.Router"],
}


def load(path: str) -> typing.Any:
    module, _, name = (A + path).rpartition(".")
    return getattr(importlib.import_module(module), name)


def every_protocol() -> set[str]:
    found = set()
    for info in pkgutil.walk_packages(amqpbroker.__path__, A):
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if inspect.isclass(obj) and obj.__module__ == module.__name__ and getattr(obj, "_is_protocol", False):
                found.add(f"{info.name[len(A):]}.{name}")
    return found


def declared(port: type) -> tuple[dict[str, typing.Any], set[str]]:
    """The port's own methods and its attributes (annotations, properties), its
    Protocol bases' included."""
    methods: dict[str, typing.Any] = {}
    attributes: set[str] = set()
    for base in reversed(port.__mro__):
        if not getattr(base, "_is_protocol", False) or base is typing.Protocol:
            continue
        for name, value in vars(base).items():
            if name.startswith("__"):
                continue
            if isinstance(value, property):
                attributes.add(name)
            elif inspect.isfunction(value):
                methods[name] = value
        attributes |= {n for n in vars(base).get("__annotations__", {}) if not n.startswith("__")}
    return methods, attributes - set(methods)


def accepts_every_call(port_fn: typing.Any, impl_fn: typing.Any) -> bool:
    """The implementation takes every call the port's signature allows."""
    want = list(inspect.signature(port_fn).parameters.values())[1:]
    have = list(inspect.signature(impl_fn).parameters.values())[1:]
    if any(p.kind is p.VAR_POSITIONAL for p in have) and any(p.kind is p.VAR_KEYWORD for p in have):
        return True
    if len(have) < len(want):
        return False
    for w, h in zip(want, have):
        if w.kind != h.kind or (w.kind is w.KEYWORD_ONLY and w.name != h.name):
            return False   # the ports' callers pass positional parameters by position
        if w.default is not inspect.Parameter.empty and h.default is inspect.Parameter.empty:
            return False
    return all(h.default is not inspect.Parameter.empty or h.kind in (h.VAR_POSITIONAL, h.VAR_KEYWORD)
               for h in have[len(want):])


def instance_members(cls: type) -> set[str]:
    """What an instance of `cls` has: its class's names (methods, class attributes,
    properties, dataclass fields, slots) and every `self.x = ...` / `self.x: T = ...`
    in the methods of it and its bases (read with `ast`)."""
    names = {n for n in dir(cls) if not n.startswith("__")}
    for klass in cls.__mro__:
        if not klass.__module__.startswith(A):
            continue
        names.update(vars(klass).get("__annotations__", {}))
        names.update(getattr(klass, "__slots__", ()))
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(klass)))):
            if isinstance(node, ast.AnnAssign):
                targets = [node.target]
            elif isinstance(node, ast.Assign):
                targets = [t for target in node.targets
                           for t in (target.elts if isinstance(target, ast.Tuple) else [target])]
            else:
                continue
            names.update(t.attr for t in targets
                         if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self")
    return names


def problems_of(proto: type, cls: type) -> list[str]:
    methods, attributes = declared(proto)
    members = instance_members(cls)
    problems = []
    for name, fn in methods.items():
        have = getattr(cls, name, None)
        if have is None and name in members:
            continue   # a callable set per instance (a clock given to __init__)
        if have is None:
            problems.append(f"no method {name}")
        elif callable(have) and not accepts_every_call(fn, have):
            problems.append(f"{name}{inspect.signature(have)} does not take every call of {inspect.signature(fn)}")
    return problems + [f"no attribute {name}" for name in sorted(attributes - members)]


def test_every_port_is_listed_with_its_implementations():
    assert every_protocol() == set(IMPLEMENTATIONS)


PAIRS = [(port, impl) for port, impls in IMPLEMENTATIONS.items() for impl in impls]


@pytest.mark.parametrize("port,impl", PAIRS, ids=[f"{p.rsplit('.', 1)[1]}-{i.rsplit('.', 1)[1]}" for p, i in PAIRS])
def test_an_implementation_has_what_its_port_declares(port, impl):
    problems = problems_of(load(port), load(impl))
    assert not problems, f"{impl} as {port}: " + "; ".join(problems)


def test_the_check_can_fail():
    class Wants(typing.Protocol):
        opened: bool

        def no_such_method(self) -> None: ...

        def attach(self, handler: typing.Any, link: typing.Any, extra: typing.Any) -> None: ...

    from amqpbroker.cluster.router import Router
    problems = problems_of(Wants, Router)
    assert problems[0] == "no method no_such_method"
    assert problems[1].startswith("attach(") and "does not take every call" in problems[1]
    assert problems[2:] == ["no attribute opened"]
