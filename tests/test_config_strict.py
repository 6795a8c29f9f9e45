"""Unknown keys are errors, in every section, present or future: each key of every
settings model, misspelt, is refused with one line that names it and the key it
resembles.  The sections and keys come from the models themselves
(config_help.walk), so a section added later is covered without a new test."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomli_w

from amqpbroker.config import ConfigError, Settings, load_settings
from amqpbroker.config_help import env_name, sections, shape_of, unknown_environment, walk


def misspelt(name: str) -> str:
    """The name with one letter of its longest word dropped (`permissions` →
    `permisions`, `port` → `prt`)."""
    words = name.split("_")
    i = max(range(len(words)), key=lambda j: len(words[j]))
    w = words[i]
    words[i] = w[:len(w) // 2] + w[len(w) // 2 + 1:]
    return "_".join(words)


def nest(section: str, table: dict) -> dict:
    """The TOML document that puts `table` at `section` ("queues[]", "users.<name>", "ha")."""
    doc: dict = table
    for part in reversed(section.split(".") if section else []):
        if part == "<name>":
            doc = {"alice": doc}
        elif part.endswith("[]"):
            doc = {part[:-2]: [doc]}
        else:
            doc = {part: doc}
    return doc


def load_toml(tmp_path: Path, doc: dict) -> Settings:
    cfg = tmp_path / "broker.toml"
    cfg.write_text(tomli_w.dumps(doc))
    return load_settings(cfg)


KEYS = [k for k in walk(Settings)]


def test_every_settings_model_forbids_unknown_keys():
    lax = [f"{s or 'top level'} ({m.__name__})" for s, m in sections(Settings)
           if m.model_config.get("extra") != "forbid"]
    assert not lax, f"settings models that ignore unknown keys (derive them from config.StrictModel): {lax}"


@pytest.mark.parametrize("key", KEYS, ids=[k.path for k in KEYS])
def test_a_misspelt_key_is_refused_naming_the_key_meant(tmp_path, key):
    wrong = misspelt(key.name)
    assert wrong not in key.owner.model_fields
    with pytest.raises(ConfigError) as refused:
        load_toml(tmp_path, nest(key.section, {wrong: 1}))
    where = ".".join(p for p in nest_loc(key.section)) + ("." if key.section else "") + wrong
    line = next((p for p in refused.value.problems if p.startswith(f"invalid setting '{where}'")), None)
    assert line is not None, refused.value.problems
    assert line == f"invalid setting '{where}': unknown key (did you mean '{key.name}'?)"


def nest_loc(section: str) -> list[str]:
    """The error location of a section: "queues[]" → queues.0, "users.<name>" → users.alice."""
    out = []
    for part in section.split(".") if section else []:
        if part == "<name>":
            out.append("alice")
        elif part.endswith("[]"):
            out += [part[:-2], "0"]
        else:
            out.append(part)
    return out


@pytest.mark.parametrize("text, line", [
    ('dead_letter_adress = "DLQ"',
     "invalid setting 'dead_letter_adress': unknown key (did you mean 'dead_letter_address' in [policy]?)"),
    ("max_conections = 5",
     "invalid setting 'max_conections': unknown key (did you mean 'max_connections' in [limits]?)"),
    ("[management]\nprot = 8000", "invalid setting 'management.prot': unknown key (did you mean 'port'?)"),
    ("[store]\nenabeld = false", "invalid setting 'store.enabeld': unknown key (did you mean 'enabled'?)"),
    ('[users.bob]\npasword = "x"', "invalid setting 'users.bob.pasword': unknown key (did you mean 'password'?)"),
    ('[tls]\ncert_file = "c"\nkey_file = "k"\ncert_usr = "cn"',
     "invalid setting 'tls.cert_usr': unknown key (did you mean 'cert_user'?)"),
    ("[managment]\nport = 1", "invalid setting 'managment': unknown key (did you mean 'management'?)"),
])
def test_the_misspellings_users_make(tmp_path, text, line):
    cfg = tmp_path / "broker.toml"
    cfg.write_text(text + "\n")
    with pytest.raises(ConfigError) as refused:
        load_settings(cfg)
    assert refused.value.problems == [line]


def test_a_misspelt_acl_key_is_one_line_not_two(tmp_path):
    """`permissions` is required: its misspelling is said once, as the unknown key."""
    cfg = tmp_path / "broker.toml"
    cfg.write_text('[[acl]]\nuser = "alice"\npermisions = ["all"]\n')
    with pytest.raises(ConfigError) as refused:
        load_settings(cfg)
    assert refused.value.problems == [
        "invalid setting 'acl.0.permisions': unknown key (did you mean 'permissions'?)"]


def test_every_problem_is_reported_not_only_the_first(tmp_path):
    cfg = tmp_path / "broker.toml"
    cfg.write_text("[limits]\nmax_conections = 1\n[store]\nenabeld = false\n[policy]\nmax_delivery_attempts = -1\n")
    with pytest.raises(ConfigError) as refused:
        load_settings(cfg)
    assert len(refused.value.problems) == 3, refused.value.problems
    assert str(refused.value).count("invalid setting") == 3      # one line for a log or an API answer


# ---------------------------------------------------------------------- the environment

def test_an_unknown_key_under_a_known_section_in_the_environment_is_refused(monkeypatch):
    monkeypatch.setenv("AMQPBROKER_LIMITS__MAX_CONECTIONS", "5")
    with pytest.raises(ConfigError) as refused:
        load_settings()
    assert refused.value.problems == [
        "invalid setting 'limits.max_conections': unknown key (did you mean 'max_connections'?) "
        "(from the environment variable AMQPBROKER_LIMITS__MAX_CONECTIONS)"]


def test_unknown_environment_names_are_warned_about_with_the_name_meant():
    env = {"AMQPBROKER_MAX_CONECTIONS": "5", "AMQPBROKER_LIMTS__MAX_CONNECTIONS": "5",
           "AMQPBROKER_PORT": "1", "AMQPBROKER_LIMITS__LINK_CREDIT": "10", "HOME": "/root",
           "AMQPBROKER_EXTRAS": "test", "AMQPBROKER_ADMIN_URL": "http://x", "AMQPBROKER_FUZZ_SEED": "1",
           "AMQPBROKER_STORE_FAULTS": "", "AMQPBROKER_NOTHING_LIKE_IT": "1"}
    assert unknown_environment(Settings, env) == [
        "environment variable AMQPBROKER_LIMTS__MAX_CONNECTIONS is not a setting and is ignored "
        "(did you mean AMQPBROKER_LIMITS__MAX_CONNECTIONS?)",
        "environment variable AMQPBROKER_MAX_CONECTIONS is not a setting and is ignored "
        "(did you mean AMQPBROKER_LIMITS__MAX_CONNECTIONS?)",
        "environment variable AMQPBROKER_NOTHING_LIKE_IT is not a setting and is ignored",
    ]


@pytest.mark.parametrize("key", [k for k in KEYS if "[]" not in k.section and shape_of(k.field.annotation).model is None],
                         ids=lambda k: k.path)
def test_every_documented_variable_name_is_one_the_broker_reads(key):
    """The names docs/configuration.md gives are settings, not warned about."""
    name = env_name(key.path).replace("<NAME>", "ALICE")
    assert unknown_environment(Settings, {name: "x"}) == []


# ---------------------------------------------------------------------- the command line

def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.upper().startswith("AMQPBROKER_")}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "amqpbroker.cli", *args], capture_output=True, text=True,
                          timeout=60, env=full_env)


def test_serve_with_a_misspelt_key_exits_2_with_one_line(tmp_path):
    cfg = tmp_path / "broker.toml"
    cfg.write_text('[[acl]]\nuser = "alice"\npermisions = ["all"]\n')
    done = run_cli("serve", "--config", str(cfg), "--port", "0", "--data-dir", str(tmp_path / "data"))
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "amqpbroker: invalid setting 'acl.0.permisions': unknown key (did you mean 'permissions'?)"]
    assert not (tmp_path / "data").exists(), "nothing was started"


def test_config_check_prints_the_effective_configuration_with_secrets_hidden(tmp_path):
    cfg = tmp_path / "broker.toml"
    cfg.write_text('port = 5999\n[users.alice]\npassword = "plain-pw"\n[[queues]]\nname = "q"\nmax_bytes = "1MiB"\n')
    done = run_cli("config", "check", str(cfg), env={"AMQPBROKER_LIMITS__LINK_CREDIT": "77",
                                                     "AMQPBROKER_MAX_CONECTIONS": "3"})
    assert done.returncode == 0, done.stderr
    import tomllib
    effective = tomllib.loads(done.stdout)
    assert effective["port"] == 5999 and effective["limits"]["link_credit"] == 77     # file + environment
    assert effective["queues"][0]["max_bytes"] == 1 << 20 and effective["limits"]["max_connections"] == 10000
    assert effective["users"]["alice"]["password"] == "<hidden: plaintext>" and "plain-pw" not in done.stdout
    assert "AMQPBROKER_MAX_CONECTIONS is not a setting" in done.stderr
    assert "plaintext password" in done.stderr


def test_config_check_reports_every_problem_and_exits_2(tmp_path):
    cfg = tmp_path / "broker.toml"
    cfg.write_text("[store]\nenabeld = false\n[management]\nprot = 1\n")
    done = run_cli("config", "check", str(cfg))
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [
        "amqpbroker: invalid setting 'store.enabeld': unknown key (did you mean 'enabled'?)",
        "amqpbroker: invalid setting 'management.prot': unknown key (did you mean 'port'?)"]


def test_config_check_runs_the_start_checks_beyond_the_models(tmp_path):
    cfg = tmp_path / "broker.toml"
    cfg.write_text('[users.eve]\npassword = "scram-sha-256$not-a-hash"\n')
    done = run_cli("config", "check", str(cfg))
    assert done.returncode == 2 and "invalid setting 'users'" in done.stderr


@pytest.mark.parametrize("text,key", [
    # An empty pattern granted everything: security/acl.py reads "" as '#'.
    ('[[acl]]\nuser = "bob"\npattern = ""\npermissions = ["consume"]', "acl.0.pattern"),
    ('[anonymous]\npattern = ""\npermissions = ["consume"]', "anonymous.pattern"),
    ('[[queue_limits]]\npattern = ""\nmax_depth = 5', "queue_limits.0.pattern"),
    ('[[queues]]\nname = ""', "queues.0.name"),
    ('[[exchanges]]\nname = " "', "exchanges.0.name"),
    ('[[bindings]]\nexchange = "amq.topic"\nqueue = ""', "bindings.0.queue"),
    ('[policy]\ndead_letter_address = "  "', "policy.dead_letter_address"),
    # ActiveMQ Artemis writes -1 for "unlimited"; here it dead-lettered at the first failure.
    ('[[queues]]\nname = "q"\nmax_delivery_attempts = -1', "queues.0.max_delivery_attempts"),
    # Which count was meant? The map took the last one.
    ('[cluster]\npartitioned = [{address = "o", members = 2}, {address = "o", members = 3}]', "cluster"),
    # Member 1 of `o`: a client of `o.p1` reached that member, never the destination declared.
    ('[cluster]\npartitioned = [{address = "o.p1", members = 2}, {address = "o", members = 2}]', "cluster"),
    ('[cluster]\npartitioned = [{address = "prices.#", members = 2, topic = true}]', "cluster"),
    ('[[exchanges]]\nname = "fx"\ntype = "fanout"\n[cluster]\npartitioned = [{address = "fx/k", members = 2}]',
     "cluster"),
])
def test_values_that_do_not_mean_what_they_look_like_are_refused(tmp_path, text, key):
    cfg = tmp_path / "broker.toml"
    cfg.write_text(text + "\n")
    with pytest.raises(ConfigError) as refused:
        load_settings(cfg)
    assert any(p.startswith(f"invalid setting '{key}'") for p in refused.value.problems), refused.value.problems


@pytest.mark.parametrize("section,text", [
    ("queue_limits", '[[queue_limits]]\npattern = "telemetry*"\nmax_depth = 5'),
    ("queue_limits", '[[queue_limits]]\npattern = "telemetry/#"\nmax_depth = 5'),
    ("acl", '[[acl]]\nuser = "bob"\npattern = "orders.eu*"\npermissions = ["consume"]'),
    ("anonymous", '[anonymous]\npattern = "public.#x"\npermissions = ["consume"]'),
])
def test_a_word_pattern_written_as_a_glob_is_refused(tmp_path, section, text):
    """`[[queue_limits]]`, `[[acl]]` and `[anonymous]` patterns are words separated by
    `.` (`*` one word, `#` any number), while `[[expiry_policies]]` and
    `[[duplicate_detection]]` take globs.  `telemetry*` there matched only a queue
    named so: the limit applied to nothing, silently."""
    cfg = tmp_path / "broker.toml"
    cfg.write_text(text + "\n")
    with pytest.raises(ConfigError) as refused:
        load_settings(cfg)
    line = " ".join(refused.value.problems)
    assert section in line and "whole words" in line, line


def test_word_patterns_users_write_are_taken(tmp_path):
    cfg = tmp_path / "broker.toml"
    cfg.write_text('[[queue_limits]]\npattern = "telemetry.#"\nmax_depth = 5\n'
                   '[[queue_limits]]\npattern = "*.dlq"\nmax_depth = 5\n'
                   '[[queue_limits]]\npattern = "#"\nmax_depth = 5\n'
                   '[[queue_limits]]\npattern = "orders-eu_v2.in"\nmax_depth = 5\n'
                   '[[acl]]\nuser = "bob"\npattern = "amq.topic/orders.#"\npermissions = ["consume"]\n')
    settings = load_settings(cfg)
    assert [r.pattern for r in settings.queue_limits] == ["telemetry.#", "*.dlq", "#", "orders-eu_v2.in"]
