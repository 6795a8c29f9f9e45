"""docs/configuration.md is generated from the settings models: it must be current
(regenerate with `amqpbroker config reference --output docs/configuration.md`), and
every key must say what it does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from amqpbroker.config import Settings
from amqpbroker.config_help import env_name, shape_of, walk
from amqpbroker.config_reference import render, shadowed_key_docs, undocumented

DOC = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


def test_every_key_has_a_description():
    assert undocumented() == [], "give these settings a Field(description=...) in amqpbroker/config.py"


def test_no_key_text_is_shadowed_or_orphaned():
    # A KEY_DOCS text for a key whose Field has a description never shows (the Field's
    # wins), and one for a removed key is dead: either would go stale unseen.
    assert shadowed_key_docs() == [], "remove these KEY_DOCS entries (or the Field description)"


def test_the_committed_reference_is_current():
    assert DOC.read_text() == render(), (
        "docs/configuration.md is stale: run `amqpbroker config reference --output docs/configuration.md`")


def test_the_reference_names_every_key_its_default_and_variable():
    text = DOC.read_text()
    for key in walk(Settings):
        if shape_of(key.field.annotation).model is not None:
            continue
        assert f"| `{key.name}` |" in text, key.path
        if "[]" not in key.section:
            assert env_name(key.path).replace("<NAME>", "<name>") in text, key.path
    # the settings a newcomer could not find before
    for needle in ("`initial_map_size`", "`max_map_size`", "`verify_at_start`", "`data_dir`", "`log_level`"):
        assert needle in text


def test_the_check_command_says_when_the_file_is_stale(tmp_path):
    stale = tmp_path / "configuration.md"
    stale.write_text(render().replace("Largest frame", "Biggest frame"))
    done = subprocess.run([sys.executable, "-m", "amqpbroker.cli", "config", "reference", "--check", str(stale)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "is stale" in done.stderr
    done = subprocess.run([sys.executable, "-m", "amqpbroker.cli", "config", "reference", "--check", str(DOC)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
