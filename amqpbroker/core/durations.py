"""Durations as configuration files and operators write them (`90`, `15m`, `7d`,
`1d12h`), and back to a short human form.  Pure: the configuration (subscription
expiry policies), the management API and its CLI read them the same way."""

from __future__ import annotations

import re

_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(value: str | int | float) -> float:
    """Seconds from `90`, `90s`, `15m`, `12h`, `7d`, `2w` or a compound like `1d12h`."""
    if isinstance(value, bool):
        raise ValueError("a duration is a number of seconds or text like '7d'")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError("a duration cannot be negative")
        return float(value)
    text = str(value).strip().lower()
    if not text:
        raise ValueError("empty duration")
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([smhdw]?)", text)
    if not parts or re.sub(r"\s+", "", "".join(n + u for n, u in parts)) != re.sub(r"\s+", "", text):
        raise ValueError(f"invalid duration '{value}' (use e.g. 30s, 15m, 12h, 7d, 2w)")
    if len(parts) > 1 and any(u == "" for _, u in parts):
        raise ValueError(f"invalid duration '{value}' (every part of a compound needs a unit)")
    return float(sum(float(n) * _UNITS[u] for n, u in parts))


def format_duration(seconds: float | None) -> str:
    """Short human form: 45s, 12m, 5h, 3d."""
    if seconds is None:
        return "-"
    s = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s / size:.0f}{unit}" if s / size >= 10 else f"{s / size:.1f}{unit}"
    return f"{s:.0f}s"
