"""Topic keys: dot-separated words; in a pattern `*` matches exactly one word and `#`
zero or more words (the AMQP 0-9-1 topic exchange model that Qpid Broker-J follows).
Used by topic exchanges' bindings (exchanges.py), queue limit rules (limits.py) and
ACL address patterns (security/acl.py); on its own so that none of them needs
another's module for it.
"""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=65536)
def topic_matches(pattern: str, key: str) -> bool:
    """AMQP topic matching: `*` one word, `#` zero or more words."""
    return _match(tuple(pattern.split(".")), tuple(key.split(".")))


def _match(pattern: tuple[str, ...], words: tuple[str, ...]) -> bool:
    """The places in `words` each prefix of the pattern can end at, one pattern word
    at a time: time len(pattern) x len(words).  (Trying every way to share the words
    among several '#' was exponential: a client's binding key `#.#.#.#.#.#.#.#.#.#.z`
    against a 20-word subject held the loop 35 s.)"""
    n = len(words)
    ends = [0]                       # ascending: where the pattern so far may end
    for head in pattern:
        if head == "#":              # zero or more words: from the first place on
            ends = list(range(ends[0], n + 1))
        elif head == "*":
            ends = [i + 1 for i in ends if i < n]
        else:
            ends = [i + 1 for i in ends if i < n and words[i] == head]
        if not ends:
            return False
    return ends[-1] == n
