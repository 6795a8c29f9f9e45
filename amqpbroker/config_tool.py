"""`amqpbroker config …`: look at a configuration without starting a broker.

    amqpbroker config check broker.toml        # the effective configuration, or the problems
    amqpbroker config check                    # the environment and defaults alone
    amqpbroker config reference                # docs/configuration.md, from the settings models
    amqpbroker config reference --output docs/configuration.md
    amqpbroker config reference --check docs/configuration.md

Exit status: 0 valid (or the reference is current), 2 invalid (each problem on its
own line on stderr), 1 the committed reference is stale.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from .config import ConfigError, Settings, load_settings

SECRET_KEYS = ("password", "secret")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="amqpbroker config", description="check a configuration; "
                                "write the configuration reference")
    sub = p.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="validate a TOML file (with the AMQPBROKER_* environment, as "
                                         "`serve` would) and print the effective configuration")
    check.add_argument("file", type=Path, nargs="?", help="the TOML file (none: environment and defaults)")
    check.add_argument("--json", action="store_true", help="print JSON instead of TOML")
    ref = sub.add_parser("reference", help="the configuration reference (markdown) from the settings models")
    where = ref.add_mutually_exclusive_group()
    where.add_argument("--output", type=Path, help="write it to this file")
    where.add_argument("--check", type=Path, metavar="FILE",
                       help="exit 1 when FILE differs from what would be written")
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.command == "check":
        return check(args.file, as_json=args.json)
    return reference(args.output, args.check)


# ---------------------------------------------------------------------- check

def check(file: Path | None, *, as_json: bool = False) -> int:
    from .config_help import unknown_environment

    # The user store and the ACL policy log their own warnings (a plaintext password).
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="amqpbroker: warning: %(message)s")
    for line in unknown_environment(Settings, os.environ):
        print(f"amqpbroker: warning: {line}", file=sys.stderr)
    try:
        settings = load_settings(file)
        deeper_checks(settings)
    except ConfigError as exc:
        for line in exc.problems:
            print(f"amqpbroker: {line}", file=sys.stderr)
        return 2
    data = hide_secrets(settings.model_dump(mode="json", exclude_none=True))
    if as_json:
        print(json.dumps(data, indent=2))
    else:
        import tomli_w
        print(f"# effective configuration: {file or 'no file'}, the AMQPBROKER_* environment and defaults")
        print("# (keys not shown are unset; docs/configuration.md says what unset means for each)")
        print(tomli_w.dumps(_toml_ready(data)), end="")
    print(f"amqpbroker: {file or 'configuration'}: valid", file=sys.stderr)
    return 0


def deeper_checks(settings: Settings) -> None:
    """What the broker checks at start beyond the models: every password hash
    parses, every ACL rule builds (the same calls a live reload makes)."""
    from .security.guard import policy_from
    from .security.users import UserStore

    try:
        UserStore({n: u.password for n, u in settings.users.items() if u.password is not None})
    except ValueError as exc:
        raise ConfigError(f"invalid setting 'users': {exc}") from None
    try:
        policy_from(settings)
    except ValueError as exc:
        raise ConfigError(f"invalid setting 'acl': {exc}") from None


def hide_secrets(value: Any, key: str = "") -> Any:
    """Passwords and secrets replaced by what kind of value they are."""
    if isinstance(value, dict):
        return {k: hide_secrets(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [hide_secrets(v, key) for v in value]
    if isinstance(value, str) and key.endswith(SECRET_KEYS):
        if value.startswith("scram-sha-256$"):
            return "<hidden: a scram-sha-256 hash>"
        return "<hidden: plaintext>" if key.endswith("password") else "<hidden>"
    return value


def _toml_ready(value: Any) -> Any:
    """TOML has no null: tables without None (exclude_none leaves none at the top,
    but inside lists of tables too)."""
    if isinstance(value, dict):
        return {k: _toml_ready(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_toml_ready(v) for v in value]
    return value


# ---------------------------------------------------------------------- reference

def reference(output: Path | None, against: Path | None) -> int:
    from .config_reference import render, undocumented

    missing = undocumented()
    if missing:
        print("amqpbroker: settings without a description (Field(description=...) in config.py): "
              + ", ".join(missing), file=sys.stderr)
        return 1
    text = render()
    if against is not None:
        if not against.is_file() or against.read_text() != text:
            print(f"amqpbroker: {against} is stale: run `amqpbroker config reference --output {against}`",
                  file=sys.stderr)
            return 1
        return 0
    if output is not None:
        output.write_text(text)
        return 0
    sys.stdout.write(text)
    return 0


__all__ = ["check", "deeper_checks", "hide_secrets", "main", "reference"]
