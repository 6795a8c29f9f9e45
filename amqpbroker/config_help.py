"""What a person needs when a setting is wrong: the settings models as a tree of
keys, "did you mean" suggestions for unknown keys, and a look at AMQPBROKER_*
environment variables that set nothing.  Pure: models and mappings in, text out.

config.py turns pydantic's errors into one line each with `problem_line`; the
reference (config_reference.py) walks the same tree with `walk`.
"""

from __future__ import annotations

import difflib
import types
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

ENV_PREFIX = "AMQPBROKER_"
ENV_NESTED = "__"

# AMQPBROKER_* names that are not settings: read by the tools around the broker.
# They are never warned about.
TOOL_ENVIRONMENT = {
    "AMQPBROKER_EXTRAS": "scripts/setup.sh: the package extras to install",
    "AMQPBROKER_ADMIN_URL": "amqpbroker admin: the management URL",
    "AMQPBROKER_ADMIN_USER": "amqpbroker admin: the user name",
    "AMQPBROKER_ADMIN_PASSWORD": "amqpbroker admin: the password",
    "AMQPBROKER_STORE_FAULTS": "tests only: store fault injection (amqpbroker/store/faults.py)",
}
TOOL_ENVIRONMENT_PREFIXES = ("AMQPBROKER_FUZZ_",)      # the wire fuzz tests' knobs


# ---------------------------------------------------------------------- the tree

@dataclass(frozen=True)
class Shape:
    """What a field holds: `model` (a settings section) directly, a `list` of them
    (`[[queues]]`), a `dict` of them by name (`[users.NAME]`), or a plain value."""
    container: str            # "", "list" or "dict"
    model: type[BaseModel] | None


def shape_of(annotation: Any) -> Shape:
    origin = get_origin(annotation)
    if origin in (Union, types.UnionType):
        for arg in get_args(annotation):
            if arg is not type(None):
                found = shape_of(arg)
                if found.model is not None:
                    return found
        return Shape("", None)
    if origin in (list, tuple, set, frozenset):
        inner = shape_of(get_args(annotation)[0])
        return Shape("list", inner.model) if inner.model else Shape("", None)
    if origin is dict:
        inner = shape_of(get_args(annotation)[1])
        return Shape("dict", inner.model) if inner.model else Shape("", None)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return Shape("", annotation)
    return Shape("", None)


@dataclass(frozen=True)
class Key:
    """One setting: `path` as written in TOML terms ("limits.max_connections",
    "queues[].name", "users.<name>.password"), its field and the model holding it."""
    path: str
    section: str              # "" for the top level, "limits", "queues[]", "users.<name>"
    name: str
    field: FieldInfo
    owner: type[BaseModel]


def _child_section(section: str, name: str, shape: Shape) -> str:
    base = f"{section}.{name}" if section else name
    return {"list": f"{base}[]", "dict": f"{base}.<name>"}.get(shape.container, base)


def walk(model: type[BaseModel], section: str = "") -> Iterator[Key]:
    """Every key of `model` and of the sections below it, depth first, in the
    order the models declare them."""
    for name, field in model.model_fields.items():
        yield Key(f"{section}.{name}" if section else name, section, name, field, model)
    for name, field in model.model_fields.items():
        shape = shape_of(field.annotation)
        if shape.model is not None:
            yield from walk(shape.model, _child_section(section, name, shape))


def sections(model: type[BaseModel], section: str = "") -> Iterator[tuple[str, type[BaseModel]]]:
    """(section, model) for `model` and every section below it."""
    yield section, model
    for name, field in model.model_fields.items():
        shape = shape_of(field.annotation)
        if shape.model is not None:
            yield from sections(shape.model, _child_section(section, name, shape))


def model_at(root: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The model whose keys apply at `loc` (a pydantic error location such as
    ("acl", 0) or ("users", "alice")); None when the location holds no section."""
    model: type[BaseModel] | None = root
    parts = list(loc)
    while parts:
        if model is None:
            return None
        field = model.model_fields.get(str(parts.pop(0)))
        if field is None:
            return None
        shape = shape_of(field.annotation)
        if shape.container and parts:
            parts.pop(0)             # the list index or the dict key
        elif shape.container:
            return None
        model = shape.model
    return model


# ---------------------------------------------------------------------- suggestions

def suggest_key(root: type[BaseModel], loc: tuple[Any, ...]) -> str | None:
    """For an unknown key at `loc`: a known key of the same section that is spelt
    nearly the same, else one of another section (a key put in the wrong place:
    `dead_letter_address` at the top level belongs in `[policy]`)."""
    unknown = str(loc[-1])
    here = model_at(root, loc[:-1])
    if here is not None:
        close = difflib.get_close_matches(unknown, list(here.model_fields), n=1, cutoff=0.6)
        if close:
            return f"'{close[0]}'"
    elsewhere = {}
    for key in walk(root):
        if key.section:
            elsewhere.setdefault(key.name, key.section)
    close = difflib.get_close_matches(unknown, list(elsewhere), n=1, cutoff=0.75)
    if close:
        return f"'{close[0]}' in {toml_section(elsewhere[close[0]])}"
    return None


def toml_section(section: str) -> str:
    """"queues[]" → "[[queues]]", "users.<name>" → "[users.<name>]", "" → "the top level"."""
    if not section:
        return "the top level"
    if section.endswith("[]"):
        return f"[[{section[:-2]}]]"
    return f"[{section}]"


def problem_line(root: type[BaseModel], error: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> str:
    """One line for one pydantic error: the key as a dotted path, what is wrong,
    for an unknown key the nearest known one, and the environment variable when
    one of that name is set (the environment wins over the file)."""
    loc = tuple(error.get("loc", ()))
    where = ".".join(str(p) for p in loc) or "(top level)"
    if error.get("type") == "extra_forbidden":
        hint = suggest_key(root, loc)
        line = f"invalid setting '{where}': unknown key" + (f" (did you mean {hint}?)" if hint else "")
    else:
        line = f"invalid setting '{where}': {error.get('msg')}"
    variable = env_name(".".join(str(p) for p in loc)) if loc else ""
    if variable and variable in {name.upper() for name in environ or {}}:
        line += f" (from the environment variable {variable})"
    return line


def problem_lines(root: type[BaseModel], errors: list[Mapping[str, Any]],
                  environ: Mapping[str, str] | None = None) -> list[str]:
    """A line per error; a required key reported missing next to an unknown key that
    is its misspelling is said once (the unknown key's line names it)."""
    misspelt = set()
    for err in errors:
        loc = tuple(err.get("loc", ()))
        if err.get("type") == "extra_forbidden" and loc:
            here = model_at(root, loc[:-1])
            close = difflib.get_close_matches(str(loc[-1]), list(here.model_fields) if here else [], 1, 0.6)
            if close:
                misspelt.add(loc[:-1] + (close[0],))
    return [problem_line(root, err, environ) for err in errors
            if not (err.get("type") == "missing" and tuple(err.get("loc", ())) in misspelt)]


# ---------------------------------------------------------------------- environment

def env_name(path: str) -> str:
    """The environment variable of a key path ("limits.max_connections" →
    AMQPBROKER_LIMITS__MAX_CONNECTIONS; "users.<name>.password" →
    AMQPBROKER_USERS__<NAME>__PASSWORD)."""
    return ENV_PREFIX + ENV_NESTED.join(part.upper() for part in path.split("."))


def unknown_environment(root: type[BaseModel], environ: Mapping[str, str]) -> list[str]:
    """Warnings for AMQPBROKER_* variables that set nothing.  A name that starts
    with a known setting or section is the settings' business (an unknown key below
    a known section is an error there); other names are ignored by the broker and
    may belong to another tool, so they are warned about, not refused."""
    top = set(root.model_fields)
    known = sorted(env_name(k.path) for k in walk(root) if "<name>" not in k.path and "[]" not in k.path)
    out = []
    for name in sorted(environ):
        upper = name.upper()
        if not upper.startswith(ENV_PREFIX) or upper in TOOL_ENVIRONMENT \
                or upper.startswith(TOOL_ENVIRONMENT_PREFIXES):
            continue
        first, nested, rest = upper[len(ENV_PREFIX):].partition(ENV_NESTED)
        if first.lower() in top:
            continue
        if nested:       # a section's name misspelt
            close = [f"{ENV_PREFIX}{c.upper()}{ENV_NESTED}{rest}"
                     for c in difflib.get_close_matches(first.lower(), sorted(top), n=1, cutoff=0.6)]
        else:
            close = difflib.get_close_matches(upper, known, n=1, cutoff=0.8)
        hint = f" (did you mean {close[0]}?)" if close else ""
        out.append(f"environment variable {name} is not a setting and is ignored{hint}")
    return out


__all__ = ["Key", "Shape", "TOOL_ENVIRONMENT", "env_name", "model_at", "problem_line", "problem_lines", "sections",
           "shape_of", "suggest_key", "toml_section", "unknown_environment", "walk"]
