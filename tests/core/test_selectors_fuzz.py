"""Property tests of JMS selectors on arbitrary input (docs/architecture.md,
"Hostile input": selector evaluation never raises):

* `compile_selector(any text)` raises SelectorError and nothing else (no
  RecursionError, no ValueError from a literal, no lark exception);
* a compiled selector's `matches(lookup)` returns a bool, never raises, whatever
  the properties hold (None, booleans, huge ints, NaN and infinities, strings,
  bytes, lists, maps, AMQP-typed values);
* `selector_accepts(selector, Message(raw), n)` never raises, for messages
  made of arbitrary bytes and sections.
"""

from __future__ import annotations

import math

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from amqpbroker.core.message import MalformedMessage, Message, selector_accepts
from amqpbroker.core.selectors import Selector, SelectorError, compile_selector
from tests.fuzz.strategies import amqp_values, hostile_messages, time_limit

compile_selector("warm = 1")      # build the parser before hypothesis times anything
fuzz = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LIMIT = 2.0

# --------------------------------------------------------------------------- selector text

KEYWORDS = ["AND", "OR", "NOT", "BETWEEN", "IN", "LIKE", "ESCAPE", "IS", "NULL", "TRUE", "FALSE",
            "not between", "Not In", "nOt LiKe"]
OPERATORS = ["=", "<>", "<", "<=", ">", ">=", "+", "-", "*", "/", "(", ")", ",", "%", "_", "'", "''"]
IDENTIFIERS = ["a", "b", "colour", "weight", "JMSType", "JMSPriority", "JMSXDeliveryCount", "$x", "_y",
               "é", "order", "and$x", "€"]
NUMBERS = ["0", "1", "-1", "007", "09", "09.5", "0x1F", "0b101", "0xG", "1e999", "1e-999", "1E308",
           "1.5f", "2d", "7.", ".5", "1_000", "99999999999999999999999999L", "1__0", "0x", "1e", "1.e5"]
STRINGS = ["'x'", "'it''s'", "'%a_'", "'\\'", "'", "'unterminated", "'é𝄞'", "''''", "'a' 'b'"]

tokens = st.sampled_from(KEYWORDS + OPERATORS + IDENTIFIERS + NUMBERS + STRINGS)
token_soup = st.lists(tokens, max_size=25).map(" ".join)
nesting = st.builds(lambda n, op, inner: op * n + inner + ")" * n * (op.endswith("(")),
                    st.integers(1, 3000), st.sampled_from(["(", "NOT ", "NOT (", "- ", "+ ", "a + ("]),
                    st.sampled_from(["a = 1", "a", "1", "'x'", ""]))
selector_text = st.one_of(st.text(max_size=60), token_soup, nesting)


@fuzz
@given(text=selector_text)
@example(text="a LIKE 'x' ESCAPE 'ab'")
@example(text="a LIKE 'x\\' ESCAPE '\\'")
@example(text="1e999 > a")
@example(text="- " * 3000 + "1 > a")
@example(text="(" * 3000 + "a = 1" + ")" * 3000)
def test_compile_raises_only_selector_error(text):
    with time_limit(LIMIT):
        try:
            selector = compile_selector(text)
        except SelectorError:
            return
        except Exception as exc:
            raise AssertionError(f"compile_selector({text[:120]!r}) raised {exc!r}") from exc
    assert isinstance(selector, Selector) and selector.text == text


# --------------------------------------------------------------------------- evaluation


@st.composite
def expressions(draw, depth: int = 0):
    """Selectors that compile (most of the time): comparisons, arithmetic, BETWEEN,
    IN, LIKE, IS NULL over a few identifiers, combined with AND / OR / NOT."""
    ident = draw(st.sampled_from(["a", "b", "c", "JMSPriority", "JMSType", "JMSXDeliveryCount"]))
    literal = draw(st.sampled_from(["0", "1", "-2", "1.5", "1e300", "'x'", "'red'", "TRUE", "NULL",
                                    "9223372036854775807", ident]))
    roll = draw(st.integers(0, 9 if depth < 3 else 5))
    if roll == 0:
        return f"{ident} {draw(st.sampled_from(['=', '<>', '<', '<=', '>', '>=']))} {literal}"
    if roll == 1:
        op = draw(st.sampled_from(["+", "-", "*", "/"]))
        return f"{ident} {op} {literal} {draw(st.sampled_from(['=', '>', '<']))} {literal}"
    if roll == 2:
        return f"{ident} {draw(st.sampled_from(['', 'NOT ']))}BETWEEN {literal} AND {literal}"
    if roll == 3:
        return f"{ident} {draw(st.sampled_from(['', 'NOT ']))}IN ('x', 'red', '')"
    if roll == 4:
        pattern = draw(st.sampled_from(["'%'", "'r_d'", "'%e%'", "'!%%' ESCAPE '!'", "''"]))
        return f"{ident} {draw(st.sampled_from(['', 'NOT ']))}LIKE {pattern}"
    if roll == 5:
        return f"{ident} IS {draw(st.sampled_from(['', 'NOT ']))}NULL"
    if roll == 6:
        return f"NOT ({draw(expressions(depth + 1))})"
    if roll == 7:
        return f"- {ident} > {literal}"
    op = draw(st.sampled_from(["AND", "OR"]))
    return f"({draw(expressions(depth + 1))}) {op} ({draw(expressions(depth + 1))})"


property_values = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(-(2**63), 2**63 - 1),
    st.floats(), st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 1e308]),
    st.text(max_size=10), st.binary(max_size=10),
    st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=3),
    amqp_values,
)


@fuzz
@given(text=expressions(), props=st.dictionaries(
    st.sampled_from(["a", "b", "c", "JMSPriority", "JMSType", "JMSXDeliveryCount"]), property_values))
@example(text="a * 1e300 > 1", props={"a": 10**400})
@example(text="a / 0 = 1", props={"a": 0})
@example(text="a - a = 0", props={"a": math.inf})
def test_matches_returns_a_bool_and_never_raises(text, props):
    try:
        selector = compile_selector(text)
    except SelectorError:
        return
    with time_limit(LIMIT):
        try:
            result = selector.matches(props.get)
        except Exception as exc:
            raise AssertionError(f"{text!r} with {props!r} raised {exc!r}") from exc
    assert result is True or result is False


# --------------------------------------------------------------------------- messages


SELECTORS = ["colour = 'red'", "weight > 2 OR colour IS NULL", "JMSType LIKE 'f%'", "JMSPriority > 4",
             "JMSXGroupID = 'g1' OR JMSCorrelationID IS NOT NULL", "JMSTimestamp > 0 AND JMSExpiration >= 0",
             "JMSXUserID = 'anonymous' OR JMSMessageID LIKE 'ID:%'", "NOT (JMSRedelivered) AND JMSXDeliveryCount < 3",
             "JMSDeliveryMode = 'PERSISTENT'", "JMSXGroupSeq BETWEEN 1 AND 5"]


@fuzz
@given(raw=hostile_messages(), text=st.sampled_from(SELECTORS), count=st.integers(0, 2**32 - 1))
def test_selector_accepts_never_raises(raw, text, count):
    try:
        msg = Message(raw)
    except MalformedMessage:
        return
    except TypeError:
        return      # codec map keys: test_regressions.py::test_codec_map_with_an_unhashable_key_raises_decode_error
    with time_limit(LIMIT):
        try:
            result = selector_accepts(compile_selector(text), msg, count)
        except Exception as exc:
            raise AssertionError(f"selector_accepts({text!r}) raised {exc!r} for {raw[:80].hex()}") from exc
    assert result is True or result is False
