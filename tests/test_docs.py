"""The documentation a new user follows says what is true: files it cites exist, no
internal jargon, commands that work with what is installed, examples that load,
counts that add up.  (Each check stands for a trap a new user fell into.)"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted([ROOT / "README.md", ROOT / "interop" / "README.md", ROOT / "bench" / "README.md",
               *(ROOT / "docs").glob("*.md")])
TOP_DIRS = ("amqpbroker", "tests", "docs", "scripts", "bench", "interop", "examples", ".ci")
GENERATED = ("bench/out/", "bench/build", "interop/cpp/build")   # made by the benchmarks and builds


def rel(p: Path) -> str:
    return str(p.relative_to(ROOT))


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_no_internal_jargon_or_files_outside_the_repository(doc):
    text = doc.read_text()
    for pattern in (r"\bthe seed\b", r"\bseed table\b", r"\bseed \d+\b", r"shared/notes/", r"/work/"):
        found = re.search(pattern, text, re.I)
        assert not found, f"{rel(doc)}: {found.group(0)!r} means nothing to a user"


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_the_repository_files_a_doc_cites_exist(doc):
    text = doc.read_text()
    cited = set(re.findall(rf"(?<![\w./-])((?:{'|'.join(map(re.escape, TOP_DIRS))})/[\w./-]*\w)", text))
    cited |= {str((doc.parent / link).resolve().relative_to(ROOT))
              for link in re.findall(r"\]\(((?!https?:|#|mailto:)[^)#\s]+)", text)}
    missing = sorted(p for p in cited if not p.startswith(GENERATED) and not (ROOT / p).exists())
    assert not missing, f"{rel(doc)} cites files that are not in the repository: {missing}"


@pytest.mark.parametrize("doc", [*DOCS, ROOT / "compose.yaml"], ids=rel)
def test_compose_commands_are_the_current_ones(doc):
    """`docker compose` (v2) in instructions; `docker-compose` only where it is named
    as the older standalone tool."""
    for line in doc.read_text().splitlines():
        command = line.strip().lstrip("#").strip()
        assert not command.startswith("docker-compose "), f"{rel(doc)}: {line.strip()}"
        assert "`docker-compose --" not in line and "`docker-compose up" not in line, f"{rel(doc)}: {line}"


def test_compose_file_has_no_obsolete_version_key():
    assert not re.search(r"^version\s*:", (ROOT / "compose.yaml").read_text(), re.M)


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_no_install_from_an_index_the_package_is_not_on(doc):
    found = re.search(r"pip install '?amqpbroker\b", doc.read_text())
    assert not found, f"{rel(doc)}: {found.group(0)!r}: the package is installed from a clone (pip install -e .)"


def test_the_readme_example_configuration_is_valid(tmp_path):
    from amqpbroker.config import load_settings
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```toml\n(# Example values.*?)```", text, re.S)
    assert block, "the README's example configuration block"
    cfg = tmp_path / "example.toml"
    cfg.write_text(block.group(1))
    load_settings(cfg)              # strict: a misspelt key in the README would fail here


def test_the_readme_quick_start_uses_commands_that_exist():
    from amqpbroker.cli import _parser
    text = (ROOT / "README.md").read_text()
    quick = text[text.index("## Quick start"):text.index("## Run the tests")]
    commands = set(re.findall(r"\.venv/bin/amqpbroker (\w[\w-]*)", quick))
    assert {"send", "receive", "admin"} <= commands, commands
    known = set(_parser()._subparsers._group_actions[0].choices)
    assert commands <= known, commands - known
    assert "./scripts/run.sh" in quick and (ROOT / "scripts" / "run.sh").stat().st_mode & 0o111


def test_the_interop_readme_count_matches_the_runner():
    sys.path.insert(0, str(ROOT / "interop"))
    try:
        import run as interop_run
    finally:
        sys.path.remove(str(ROOT / "interop"))
    text = (ROOT / "interop" / "README.md").read_text()
    header = re.search(r"^client\s+(queue\s.*)$", text, re.M).group(1).split()
    assert set(header) | {"types"} == set(interop_run.SCENARIOS)
    example = text[text.index("client x scenario"):text.index("not applicable")]
    passes = len(re.findall(r"\bpass\b", example))
    total = int(re.search(r"^(\d+) passed, 0 failed$", text, re.M).group(1))
    clients = len(interop_run.ALL_CLIENTS)
    not_applicable = len(re.findall(r"^  \w+/\w+: ", text, re.M))
    assert passes == total == clients * (len(interop_run.SCENARIOS) - 1) - not_applicable + clients ** 2


def documented_metrics() -> set[str]:
    """Metric names in docs/operations.md, with the table's shorthand expanded
    (`amqpbroker_queue_depth`, `_bytes` is amqpbroker_queue_bytes)."""
    names: set[str] = set()
    for line in (ROOT / "docs" / "operations.md").read_text().splitlines():
        last = None
        for token in re.findall(r"`(_?[a-z][a-z_]*)`", line):
            if token.startswith("amqpbroker_"):
                names.add(token)
                last = token
            elif token.startswith("_") and last:
                cuts = [i for i, c in enumerate(last) if c == "_"]
                names.update(last[:i] + token for i in cuts)
    return names


def test_every_metric_the_broker_exports_is_in_the_metrics_reference():
    emitted = set()
    for path in [*(ROOT / "amqpbroker" / "management").glob("*.py"), *(ROOT / "amqpbroker" / "ha").glob("*.py")]:
        emitted |= set(re.findall(r"[\"'](amqpbroker_[a-z_]+)[\"']", path.read_text()))
    missing = sorted(emitted - documented_metrics())
    assert emitted and not missing, f"metrics missing from docs/operations.md \"Metrics\": {missing}"
