"""Run-time half of JMS message selectors: value kinds, three-valued logic, closures.

Every compiled expression is a closure ``fn(lookup) -> value``. UNKNOWN (SQL NULL) is
represented by ``None`` throughout (JMS 2.0 §3.8.1.1, SQL-92 three-valued logic); boolean
expressions return ``True`` / ``False`` / ``None``.
"""

from __future__ import annotations

import operator
from typing import Any, Callable

from .like import like_matcher  # noqa: F401 - the compiler takes it from here

Lookup = Callable[[str], Any]
Fn = Callable[[Lookup], Any]

# Value kinds. Run-time values are NUM/STR/BOOL/BYTES/OTHER; ANY (identifier, parenthesised
# identifier) and NULL (the NULL literal) only exist at compile time.
NUM, STR, BOOL, BYTES, OTHER, ANY, NULL = range(1, 8)
KIND_NAMES = {NUM: "numeric", STR: "string", BOOL: "boolean", BYTES: "binary",
              OTHER: "other", ANY: "identifier", NULL: "NULL"}

_KINDS: dict[type, int] = {bool: BOOL, int: NUM, float: NUM, str: STR, bytes: BYTES}
_FAST = {NUM: frozenset((int, float)), STR: frozenset((str,)), BOOL: frozenset((bool,)),
         BYTES: frozenset((bytes,))}
_FAST_NUM = _FAST[NUM]


def kind_of(value: Any) -> int:
    """Kind of a non-None value; subclasses (proton ulong, symbol, ...) map to their base."""
    kind = _KINDS.get(type(value))
    if kind is None:
        t = type(value)
        if issubclass(t, (int, float)):  # bool cannot be subclassed
            kind = NUM
        elif issubclass(t, str):
            kind = STR
        elif issubclass(t, bytes):
            kind = BYTES
        else:
            kind = OTHER  # uuid.UUID, Decimal, lists ...: not comparable -> UNKNOWN
        if len(_KINDS) < 256:
            _KINDS[t] = kind
    return kind


class Node:
    """A compiled sub-expression: closure plus what the compiler knows statically."""

    __slots__ = ("fn", "kind", "const", "value", "name")

    def __init__(self, fn: Fn, kind: int, const: bool = False, value: Any = None,
                 name: str | None = None) -> None:
        self.fn, self.kind, self.const, self.value, self.name = fn, kind, const, value, name


def _no_lookup(name: str) -> Any:  # constant folding never reads identifiers
    raise AssertionError(f"constant expression read {name!r}")


def constant(value: Any, kind: int | None = None) -> Node:
    if kind is None:
        kind = NULL if value is None else kind_of(value)
    return Node(lambda lookup: value, kind, const=True, value=value)


def node(fn: Fn, kind: int, *children: Node) -> Node:
    """Wrap ``fn``; folds it to a constant when every child is constant."""
    if children and all(c.const for c in children):
        return constant(fn(_no_lookup), kind)
    return Node(fn, kind)


# --- three-valued logic (§3.8.1.1 tables for AND, OR, NOT) ------------------------------

def as_condition(n: Node) -> Fn:
    """Boolean view of an expression: a non-boolean value is UNKNOWN."""
    if n.kind == BOOL:
        return n.fn
    if n.name is not None:
        name = n.name

        def ident_cond(lookup: Lookup) -> Any:
            v = lookup(name)
            return v if v is True or v is False else None
        return ident_cond
    fn = n.fn

    def cond(lookup: Lookup) -> Any:
        v = fn(lookup)
        return v if v is True or v is False else None
    return cond


def and_fn(fns: list[Fn]) -> Fn:
    if len(fns) == 2:
        f1, f2 = fns

        def and2(lookup: Lookup) -> Any:
            a = f1(lookup)
            if a is False:
                return False
            b = f2(lookup)
            if b is False:
                return False
            return True if a is True and b is True else None
        return and2

    def and_n(lookup: Lookup) -> Any:
        result: Any = True
        for f in fns:
            r = f(lookup)
            if r is False:
                return False
            if r is None:
                result = None
        return result
    return and_n


def or_fn(fns: list[Fn]) -> Fn:
    if len(fns) == 2:
        f1, f2 = fns

        def or2(lookup: Lookup) -> Any:
            a = f1(lookup)
            if a is True:
                return True
            b = f2(lookup)
            if b is True:
                return True
            return False if a is False and b is False else None
        return or2

    def or_n(lookup: Lookup) -> Any:
        result: Any = False
        for f in fns:
            r = f(lookup)
            if r is True:
                return True
            if r is None:
                result = None
        return result
    return or_n


def not_fn(f: Fn) -> Fn:
    def not_(lookup: Lookup) -> Any:
        r = f(lookup)
        return None if r is None else not r
    return not_


# --- comparisons (§3.8.1.1 "Comparison operators") ---------------------------------------

EQUALITY = {"=": operator.eq, "<>": operator.ne}
ORDERING = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge}
FLIPPED = {"=": "=", "<>": "<>", "<": ">", "<=": ">=", ">": "<", ">=": "<="}


def compare(op: Callable[[Any, Any], bool], ordered: bool, a: Any, b: Any) -> Any:
    """NULL -> UNKNOWN; non-like types -> FALSE; int/float compare numerically.

    Values of an unsupported type (uuid, ...) and ordering of strings, booleans or binary
    (only = and <> are defined for them) give UNKNOWN.
    """
    if a is None or b is None:
        return None
    ka, kb = kind_of(a), kind_of(b)
    if ka == OTHER or kb == OTHER:
        return None
    if ka != kb:
        return False
    if ordered and ka != NUM:
        return None
    return op(a, b)


def compare_fn(opname: str, left: Node, right: Node) -> Fn:
    if left.const and right.name is not None:
        left, right, opname = right, left, FLIPPED[opname]
    ordered = opname in ORDERING
    op = ORDERING[opname] if ordered else EQUALITY[opname]
    if left.name is not None and right.const and right.value is not None:
        name, c = left.name, right.value
        fast = _FAST.get(kind_of(c), frozenset())

        def cmp_ident_const(lookup: Lookup) -> Any:
            v = lookup(name)
            if type(v) in fast:
                return op(v, c)
            return compare(op, ordered, v, c)
        return cmp_ident_const
    lf, rf = left.fn, right.fn
    return lambda lookup: compare(op, ordered, lf(lookup), rf(lookup))


def between_fn(negated: bool, value: Node, low: Node, high: Node) -> Fn:
    """``v BETWEEN lo AND hi`` is ``v >= lo AND v <= hi``; NOT BETWEEN is
    ``v < lo OR v > hi`` (both as the spec defines them)."""
    vf, lof, hif = value.fn, low.fn, high.fn
    ge, le, lt, gt = operator.ge, operator.le, operator.lt, operator.gt
    if (value.name is not None and low.const and high.const
            and type(low.value) in _FAST_NUM and type(high.value) in _FAST_NUM):
        name, lo_c, hi_c = value.name, low.value, high.value

        def between_const(lookup: Lookup) -> Any:
            v = lookup(name)
            if type(v) in _FAST_NUM:
                return (v < lo_c or v > hi_c) if negated else (lo_c <= v <= hi_c)
            if v is None:
                return None
            k = kind_of(v)
            if k == NUM:
                return (v < lo_c or v > hi_c) if negated else (lo_c <= v <= hi_c)
            return None if k == OTHER else False
        return between_const

    def between(lookup: Lookup) -> Any:
        v, lo, hi = vf(lookup), lof(lookup), hif(lookup)
        if type(v) in _FAST_NUM and type(lo) in _FAST_NUM and type(hi) in _FAST_NUM:
            return (v < lo or v > hi) if negated else (lo <= v <= hi)
        if negated:
            a, b = compare(lt, True, v, lo), compare(gt, True, v, hi)
            if a is True or b is True:
                return True
            return False if a is False and b is False else None
        a, b = compare(ge, True, v, lo), compare(le, True, v, hi)
        return False if a is False or b is False else (True if a is True and b is True else None)
    return between


def string_predicate_fn(name: str, test: Callable[[str], bool], negated: bool) -> Fn:
    """[NOT] IN / [NOT] LIKE on an identifier: NULL -> UNKNOWN; a non-string value is a
    comparison of non-like types, so FALSE for both the plain and the NOT form."""

    def predicate(lookup: Lookup) -> Any:
        v = lookup(name)
        if type(v) is str:
            return test(v) is not negated
        if v is None:
            return None
        k = kind_of(v)
        if k == STR:
            return test(v) is not negated
        return None if k == OTHER else False
    return predicate


def is_null_fn(name: str, negated: bool) -> Fn:
    if negated:
        return lambda lookup: lookup(name) is not None
    return lambda lookup: lookup(name) is None


# --- arithmetic (§3.8.1.1 "Arithmetic operators": Java numeric promotion) ----------------

def java_div(a: Any, b: Any) -> Any:
    """Java division: long / long truncates toward zero; anything else is floating."""
    if isinstance(a, int) and isinstance(b, int):
        q = abs(a) // abs(b)  # ZeroDivisionError on 0 -> UNKNOWN
        return q if (a < 0) == (b < 0) else -q
    return a / b


ARITH = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": java_div}


def arith_fn(opname: str, left: Node, right: Node) -> Fn:
    op, lf, rf = ARITH[opname], left.fn, right.fn

    def arith(lookup: Lookup) -> Any:
        a, b = lf(lookup), rf(lookup)
        if a is None or b is None:
            return None
        if ((type(a) in _FAST_NUM or kind_of(a) == NUM)
                and (type(b) in _FAST_NUM or kind_of(b) == NUM)):
            try:
                return op(a, b)
            except (ZeroDivisionError, OverflowError):  # x / 0, huge int -> float
                return None
        return None  # arithmetic on a non-number: UNKNOWN
    return arith


def negate_fn(operand: Node, minus: bool) -> Fn:
    f = operand.fn

    def unary(lookup: Lookup) -> Any:
        a = f(lookup)
        if a is None or kind_of(a) != NUM:
            return None
        return -a if minus else a
    return unary

