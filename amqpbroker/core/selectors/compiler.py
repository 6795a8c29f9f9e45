"""JMS 2.0 message selectors (§3.8.1, Jakarta Messaging 3.1 §3.8.1): parse and compile.

``compile_selector(text)`` parses with lark (LALR, ``grammar.lark``), checks the static
rules of §3.8.1.1 and turns the tree into nested closures (``evaluator``) so that matching
a message never walks a parse tree.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any, Callable

from lark import Lark, Token, Tree
from lark.exceptions import UnexpectedCharacters, UnexpectedInput, UnexpectedToken

from ..ratelog import RateLimitedLog
from . import evaluator as ev
from .evaluator import ANY, BOOL, KIND_NAMES, NULL, NUM, STR, Node
from .like import SelectorBudgetExceeded, begin_evaluation

log = logging.getLogger("amqpbroker.selectors")
_budget_log = RateLimitedLog(log)


class SelectorError(ValueError):
    """An invalid selector; the message names the problem and its position."""


# Shape limits: the parse tree is checked before it is compiled (the compiler and the
# closures it builds recurse once per level).  Chains of one operator (a OR b OR c ...)
# are flattened and count as one level; a selector's length is limited where clients
# send it (limits.max_selector_length, `check_length`: the AMQP attach, the management
# API and with it the CLI), since parsing costs ~4 µs a character.
MAX_DEPTH = 64
MAX_TERMS = 5000


class Stats:
    """Evaluations stopped by their budget (core/selectors/like.py), for metrics."""
    budget_exceeded_total = 0


def check_length(text: str, limit: int) -> None:
    """The one length limit of every place a selector comes in (SelectorError)."""
    if len(text) > limit:
        raise SelectorError(f"selector of {len(text):,} characters is longer than {limit} characters "
                            "(limits.max_selector_length)")


class Selector:
    """A compiled selector. ``matches(lookup)`` is True only when it evaluates to TRUE."""

    __slots__ = ("text", "identifiers", "_fn")

    def __init__(self, text: str, identifiers: frozenset[str], fn: ev.Fn) -> None:
        self.text = text
        self.identifiers = identifiers
        self._fn = fn

    def matches(self, lookup: Callable[[str], object]) -> bool:
        """True only when the selector evaluates to TRUE.  Raises
        SelectorBudgetExceeded (a ValueError) when the evaluation would cost more than
        its budget (like.py): counted, and logged at most once per 10 s."""
        begin_evaluation()
        try:
            return self._fn(lookup) is True
        except SelectorBudgetExceeded as exc:
            Stats.budget_exceeded_total += 1
            _budget_log.log(logging.WARNING, "budget", "selector %r: %s; the message does not match it",
                            self.text[:80], exc)
            raise

    def __repr__(self) -> str:
        return f"Selector({self.text!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Selector) and other.text == self.text

    def __hash__(self) -> int:
        return hash(self.text)


@functools.lru_cache(maxsize=4096)
def compile_selector(text: str) -> Selector:
    """Compile a JMS message selector; raises SelectorError if it is invalid.

    Results are cached (many subscribers share a selector). An empty or blank selector
    means "no selector" in JMS (§3.8.1.1); callers must handle that before calling this,
    which rejects it with SelectorError like any other text that is not a condition.
    """
    if not isinstance(text, str):
        raise TypeError(f"selector must be a str, not {type(text).__name__}")
    if not text.strip():
        raise SelectorError("empty selector")
    try:
        tree = _parser().parse(text)
    except UnexpectedInput as exc:
        raise SelectorError(_syntax_message(exc, text)) from None
    _check_shape(tree)
    compiler = _Compiler(text)
    root = compiler.build(tree)
    if root.kind not in (BOOL, ANY, NULL):
        raise SelectorError(f"selector is a {KIND_NAMES[root.kind]} expression, "
                            f"not a condition, at {_where(text, tree)}")
    return Selector(text, frozenset(compiler.identifiers), ev.as_condition(root))


_FLAT = ("or_op", "and_op")


def _check_shape(tree: Tree) -> None:
    """Nesting and size of the parse tree, walked without recursion."""
    stack = [(tree, 1)]
    terms = 0
    while stack:
        node, depth = stack.pop()
        terms += 1
        if terms > MAX_TERMS:
            raise SelectorError(f"selector has more than {MAX_TERMS} terms")
        if depth > MAX_DEPTH:
            raise SelectorError(f"selector is nested deeper than {MAX_DEPTH} levels")
        for child in node.children:
            if isinstance(child, Tree):
                flat = child.data == node.data and node.data in _FLAT
                stack.append((child, depth if flat else depth + 1))


@functools.cache
def _parser() -> Lark:
    grammar = Path(__file__).with_name("grammar.lark").read_text(encoding="utf-8")
    return Lark(grammar, parser="lalr", lexer="basic", propagate_positions=True)


# --- error messages ----------------------------------------------------------------------

_TERMINAL_NAMES = {
    "IDENT": "identifier", "NUMBER": "number", "STRING": "string", "LPAR": "'('",
    "RPAR": "')'", "COMMA": "','", "COMP_OP": "comparison operator", "ADD_OP": "'+'/'-'",
    "MUL_OP": "'*'/'/'", "NOT_BETWEEN": "NOT BETWEEN", "NOT_IN": "NOT IN",
    "NOT_LIKE": "NOT LIKE", "$END": "end of selector",
}


def _position(text: str, line: int | None, column: int | None) -> str:
    if line is not None and line > 1:
        return f"line {line}, column {column}"
    return f"column {column}"


def _where(text: str, item: Tree | Token) -> str:
    if isinstance(item, Token):
        return _position(text, item.line, item.column)
    meta = item.meta
    return _position(text, getattr(meta, "line", None), getattr(meta, "column", None))


def _syntax_message(exc: UnexpectedInput, text: str) -> str:
    if isinstance(exc, UnexpectedCharacters):
        where = _position(text, exc.line, exc.column)
        if exc.char == "'":
            return f"unterminated string literal at {where}"
        return f"unexpected character {exc.char!r} at {where}"
    if isinstance(exc, UnexpectedToken):
        expected = sorted({_TERMINAL_NAMES.get(t, t) for t in exc.expected})
        hint = f"; expected {', '.join(expected)}" if expected else ""
        if exc.token.type == "$END":
            lines = text.rstrip().split("\n")
            return (f"unexpected end of selector at "
                    f"{_position(text, len(lines), len(lines[-1]) + 1)}{hint}")
        where = _position(text, exc.token.line, exc.token.column)
        return f"unexpected token {str(exc.token)!r} at {where}{hint}"
    return f"syntax error at {_position(text, exc.line, exc.column)}"  # pragma: no cover


# --- literals ----------------------------------------------------------------------------

def _number(tok: Token, text: str) -> Any:
    """Java integer / floating-point literal syntax (§3.8.1.1 "Literals")."""
    s = tok.value.replace("_", "").lower()
    if s.startswith(("0x", "0b")):
        return int(s[2:].rstrip("l"), 16 if s[1] == "x" else 2)
    if "." in s or "e" in s or s[-1] in "fd":
        value = float(s[:-1] if s[-1] in "fd" else s)
        if value == float("inf"):
            raise SelectorError(f"numeric literal {tok.value!r} is out of range "
                                f"at {_where(text, tok)}")
        return value
    s = s.rstrip("l")
    if len(s) > 1 and s[0] == "0":  # Java octal
        if any(c in "89" for c in s):
            raise SelectorError(f"invalid octal literal {tok.value!r} at {_where(text, tok)}")
        return int(s, 8)
    return int(s)


def _string(tok: Token) -> str:
    return tok.value[1:-1].replace("''", "'")


# --- tree -> closures --------------------------------------------------------------------

_BOOLEAN_OK = (BOOL, ANY, NULL)
_NUMERIC_OK = (NUM, ANY, NULL)


class _Compiler:
    def __init__(self, text: str) -> None:
        self.text = text
        self.identifiers: set[str] = set()

    def error(self, message: str, item: Tree | Token) -> SelectorError:
        return SelectorError(f"{message} at {_where(self.text, item)}")

    def build(self, t: Tree) -> Node:
        return getattr(self, "_" + t.data)(t)

    def _check(self, t: Tree, n: Node, allowed: tuple[int, ...], what: str) -> Node:
        if n.kind not in allowed:
            raise self.error(f"{what}, not a {KIND_NAMES[n.kind]} value,", t)
        return n

    def _ident_name(self, tok: Token) -> str:
        self.identifiers.add(tok.value)
        return tok.value

    # literals and identifiers
    def _string(self, t: Tree) -> Node:
        return ev.constant(_string(t.children[0]), STR)

    def _number(self, t: Tree) -> Node:
        return ev.constant(_number(t.children[0], self.text), NUM)

    def _true(self, t: Tree) -> Node:
        return ev.constant(True, BOOL)

    def _false(self, t: Tree) -> Node:
        return ev.constant(False, BOOL)

    def _null(self, t: Tree) -> Node:
        return ev.constant(None, NULL)

    def _ident(self, t: Tree) -> Node:
        name = self._ident_name(t.children[0])
        return Node(lambda lookup: lookup(name), ANY, name=name)

    # logic (§3.8.1.1: NOT, AND, OR with the SQL-92 truth tables)
    def _logical(self, t: Tree, word: str) -> list[Node]:
        operands: list[Node] = []
        stack = [t]
        while stack:  # flatten left-nested chains into one n-ary operator
            cur = stack.pop()
            left, right = cur.children[0], cur.children[2]
            for child in (right, left):
                if isinstance(child, Tree) and child.data == t.data:
                    stack.append(child)
                else:
                    operands.append(self._check(child, self.build(child), _BOOLEAN_OK,
                                                f"{word} needs a condition"))
        operands.reverse()
        return operands

    def _or_op(self, t: Tree) -> Node:
        nodes = self._logical(t, "OR")
        return ev.node(ev.or_fn([ev.as_condition(n) for n in nodes]), BOOL, *nodes)

    def _and_op(self, t: Tree) -> Node:
        nodes = self._logical(t, "AND")
        return ev.node(ev.and_fn([ev.as_condition(n) for n in nodes]), BOOL, *nodes)

    def _not_op(self, t: Tree) -> Node:
        operand = self._check(t.children[1], self.build(t.children[1]), _BOOLEAN_OK,
                              "NOT needs a condition")
        return ev.node(ev.not_fn(ev.as_condition(operand)), BOOL, operand)

    # comparisons (§3.8.1.1: strings and booleans only with = and <>)
    def _comparison(self, t: Tree) -> Node:
        left_t, op, right_t = t.children
        left, right = self.build(left_t), self.build(right_t)
        if op.value in ev.ORDERING:
            what = f"'{op.value}' compares numbers"
            self._check(left_t, left, _NUMERIC_OK, what)
            self._check(right_t, right, _NUMERIC_OK, what)
        if left.kind == NULL or right.kind == NULL:
            return ev.constant(None, BOOL)  # comparison with NULL is UNKNOWN
        return ev.node(ev.compare_fn(op.value, left, right), BOOL, left, right)

    def _between(self, t: Tree, negated: bool = False) -> Node:
        value_t, _, low_t, _, high_t = t.children
        nodes = []
        for item in (value_t, low_t, high_t):
            nodes.append(self._check(item, self.build(item), _NUMERIC_OK,
                                     "BETWEEN compares numbers"))
        return ev.node(ev.between_fn(negated, *nodes), BOOL, *nodes)

    def _not_between(self, t: Tree) -> Node:
        return self._between(t, negated=True)

    def _in_op(self, t: Tree, negated: bool = False) -> Node:
        name = self._ident_name(t.children[0])
        values = []
        for item in t.children[2].children:
            if item.data != "string":
                raise self.error("IN list elements must be string literals, "
                                 f"not {str(item.children[0])!r},", item)
            values.append(_string(item.children[0]))
        return Node(ev.string_predicate_fn(name, frozenset(values).__contains__, negated), BOOL)

    def _not_in(self, t: Tree) -> Node:
        return self._in_op(t, negated=True)

    def _like(self, t: Tree, negated: bool = False) -> Node:
        ident, _, pattern_tok, *rest = t.children
        name = self._ident_name(ident)
        escape = None
        if rest:
            escape_tok = rest[1]
            escape = _string(escape_tok)
            if len(escape) != 1:
                raise self.error("ESCAPE must be a single character, "
                                 f"not {escape_tok.value},", escape_tok)
        try:
            matcher = ev.like_matcher(_string(pattern_tok), escape)
        except ValueError as exc:
            raise self.error(str(exc), pattern_tok) from None
        return Node(ev.string_predicate_fn(name, matcher, negated), BOOL)

    def _not_like(self, t: Tree) -> Node:
        return self._like(t, negated=True)

    def _is_null(self, t: Tree, negated: bool = False) -> Node:
        return Node(ev.is_null_fn(self._ident_name(t.children[0]), negated), BOOL)

    def _is_not_null(self, t: Tree) -> Node:
        return self._is_null(t, negated=True)

    # arithmetic (§3.8.1.1: numeric operands only, Java numeric promotion)
    def _arith(self, t: Tree) -> Node:
        left_t, op, right_t = t.children
        what = f"'{op.value}' needs numbers"
        left = self._check(left_t, self.build(left_t), _NUMERIC_OK, what)
        right = self._check(right_t, self.build(right_t), _NUMERIC_OK, what)
        return ev.node(ev.arith_fn(op.value, left, right), NUM, left, right)

    def _unary_op(self, t: Tree) -> Node:
        op, operand_t = t.children
        operand = self._check(operand_t, self.build(operand_t), _NUMERIC_OK,
                              f"unary '{op.value}' needs a number")
        return ev.node(ev.negate_fn(operand, op.value == "-"), NUM, operand)
