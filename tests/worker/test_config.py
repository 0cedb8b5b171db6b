"""load_config: resolution, validation with one-line errors, and the default document."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import pytest
import tomli_w

from worker.config import (
    Config,
    DeadlineConfig,
    HeartbeatConfig,
    ModelConfig,
    RestartConfig,
    ToolsConfig,
    config_changes,
    config_document,
    default_config_document,
    default_config_text,
    load_config,
    parse_period,
    period_text,
    read_config,
)
from worker.errors import ConfigError
from worker.tools.sandbox import SandboxMode

SHIPPED = Path(__file__).resolve().parents[2] / "config" / "agentd.toml"


def _write(tmp_path: Path, text: str, name: str = "agentd.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _error(path: Path) -> str:
    """The message of the ConfigError that loading ``path`` raises, checked to be one line."""
    with pytest.raises(ConfigError) as caught:
        load_config(path, environ={})
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"{path}: ")
    assert message.endswith(".")
    assert caught.value.exit_code == 78
    return message


def _without_source(config: Config) -> Config:
    return dataclasses.replace(config, source=None)


# -- resolution ------------------------------------------------------------------------


def test_no_file_anywhere_means_defaults() -> None:
    assert load_config(environ={}) == Config()


def test_an_empty_env_var_means_no_file() -> None:
    assert load_config(environ={"AGENTD_CONFIG": ""}) == Config()


def test_env_var_names_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "max_workers = 3\n")

    config = load_config(environ={"AGENTD_CONFIG": str(path)})

    assert config.max_workers == 3
    assert config.source == path


def test_an_explicit_path_beats_the_env_var(tmp_path: Path) -> None:
    explicit = _write(tmp_path, "max_workers = 2\n", "explicit.toml")
    from_env = _write(tmp_path, "max_workers = 3\n", "env.toml")

    config = load_config(explicit, environ={"AGENTD_CONFIG": str(from_env)})

    assert (config.max_workers, config.source) == (2, explicit)


def test_default_environ_is_the_process_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGENTD_CONFIG", str(_write(tmp_path, "max_workers = 4\n")))

    assert load_config().max_workers == 4


def test_a_missing_explicit_file_is_an_error(tmp_path: Path) -> None:
    message = _error(tmp_path / "nope.toml")

    assert "not found" in message
    assert "agentd init" in message


def test_a_missing_file_named_by_the_env_var_says_so(tmp_path: Path) -> None:
    path = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match=r"\$AGENTD_CONFIG") as caught:
        load_config(environ={"AGENTD_CONFIG": str(path)})
    assert str(caught.value).startswith(f"{path}: ")


def test_a_folder_is_not_a_config_file(tmp_path: Path) -> None:
    assert "folder" in _error(tmp_path)


# -- values ----------------------------------------------------------------------------


def test_an_empty_file_is_all_defaults(tmp_path: Path) -> None:
    path = _write(tmp_path, "")

    config = load_config(path, environ={})

    assert config == dataclasses.replace(Config(), source=path)


def test_every_key_is_read(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        """
spool = "/srv/agentd"
max_workers = 3
[heartbeat]
interval = 0.5
timeout = 4
[deadlines]
model_call = 120
tool_call = 30.5
[restart]
backoff_initial = 2
backoff_max = 90
crash_loop_limit = 7
stop_grace = 5
[model]
name = "claude-opus-4-1"
max_tokens = 8192
[tools]
modules = ["acme.tools", "acme_extra"]
sandbox = "required"
network = false
[tools.policy]
run_command = "rerun"
append-file = "hold"
""",
    )

    config = load_config(path, environ={})

    assert config == Config(
        spool=Path("/srv/agentd"),
        max_workers=3,
        heartbeat=HeartbeatConfig(interval=0.5, timeout=4.0),
        deadlines=DeadlineConfig(model_call=120.0, tool_call=30.5),
        restart=RestartConfig(
            backoff_initial=2.0, backoff_max=90.0, crash_loop_limit=7, stop_grace=5.0
        ),
        model=ModelConfig(name="claude-opus-4-1", max_tokens=8192),
        tools=ToolsConfig(
            modules=("acme.tools", "acme_extra"),
            sandbox=SandboxMode.REQUIRED,
            network=False,
            policy={"run_command": "rerun", "append-file": "hold"},
        ),
        source=path,
    )


def test_ints_become_floats_for_durations(tmp_path: Path) -> None:
    config = load_config(_write(tmp_path, "[heartbeat]\ninterval = 2\ntimeout = 20\n"), environ={})

    assert type(config.heartbeat.interval) is float
    assert config.heartbeat == HeartbeatConfig(interval=2.0, timeout=20.0)


def test_a_partial_table_keeps_the_other_defaults(tmp_path: Path) -> None:
    config = load_config(_write(tmp_path, "[restart]\nstop_grace = 3\n"), environ={})

    assert config.restart == dataclasses.replace(RestartConfig(), stop_grace=3.0)
    assert config.heartbeat == HeartbeatConfig()


def test_loaded_collections_are_immutable(tmp_path: Path) -> None:
    path = _write(tmp_path, '[tools]\nmodules = ["a"]\n[tools.policy]\nx = "hold"\n')

    tools = load_config(path, environ={}).tools

    assert isinstance(tools.modules, tuple)
    with pytest.raises(TypeError):
        tools.policy["x"] = "rerun"  # type: ignore[index]


def test_spool_tilde_is_expanded_with_home(tmp_path: Path) -> None:
    path = _write(tmp_path, 'spool = "~/agentd-spool"\n')

    config = load_config(path, environ={"HOME": "/srv/operator"})

    assert config.spool == Path("/srv/operator/agentd-spool")


def test_a_relative_spool_is_relative_to_the_config_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "etc").mkdir()
    _write(tmp_path / "etc", 'spool = "spool"\n')
    monkeypatch.chdir(tmp_path)

    config = load_config(Path("etc/agentd.toml"), environ={})

    assert config.spool == tmp_path / "etc" / "spool"
    assert config.spool.is_absolute()


# -- bad input: one line naming the file, the key and what is allowed ------------------

DURATIONS = [
    ("heartbeat", "interval"),
    ("heartbeat", "timeout"),
    ("deadlines", "model_call"),
    ("deadlines", "tool_call"),
    ("restart", "backoff_initial"),
    ("restart", "backoff_max"),
    ("restart", "stop_grace"),
]


@pytest.mark.parametrize(("table", "key"), DURATIONS)
@pytest.mark.parametrize("bad", ["0", "-1", "-0.5", "nan", "inf", '"5"', "true", "[1]"])
def test_a_duration_must_be_a_positive_number(
    tmp_path: Path, table: str, key: str, bad: str
) -> None:
    message = _error(_write(tmp_path, f"[{table}]\n{key} = {bad}\n"))

    assert f"{table}.{key} must be a number of seconds greater than 0, got " in message


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("max_workers = 0", "max_workers"),
        ("max_workers = -3", "max_workers"),
        ("max_workers = 2.5", "max_workers"),
        ('max_workers = "8"', "max_workers"),
        ("max_workers = true", "max_workers"),
        ("[restart]\ncrash_loop_limit = 0", "restart.crash_loop_limit"),
        ("[restart]\ncrash_loop_limit = 1.0", "restart.crash_loop_limit"),
        ("[model]\nmax_tokens = 0", "model.max_tokens"),
    ],
)
def test_counts_must_be_whole_numbers_of_at_least_one(tmp_path: Path, text: str, key: str) -> None:
    message = _error(_write(tmp_path, text + "\n"))

    assert f"{key} must be a whole number of at least 1, got " in message


def test_the_heartbeat_timeout_must_exceed_the_interval(tmp_path: Path) -> None:
    path = _write(tmp_path, "[heartbeat]\ntimeout = 0.5\n")

    assert _error(path) == (
        f"{path}: heartbeat.timeout must be a number of seconds greater than "
        f"heartbeat.interval (1.0), got 0.5."
    )


def test_a_heartbeat_timeout_equal_to_the_interval_is_refused(tmp_path: Path) -> None:
    message = _error(_write(tmp_path, "[heartbeat]\ninterval = 5\ntimeout = 5\n"))

    assert (
        "heartbeat.timeout must be a number of seconds greater than heartbeat.interval" in message
    )


def test_the_backoff_cap_must_not_be_below_its_start(tmp_path: Path) -> None:
    message = _error(_write(tmp_path, "[restart]\nbackoff_initial = 30\nbackoff_max = 10\n"))

    assert "restart.backoff_max must be a number of seconds of at least" in message
    assert "restart.backoff_initial (30.0), got 10.0" in message


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("colour = 1", "colour is not a known key; the top level takes spool, max_workers,"),
        (
            "[heartbeat]\nintervall = 1",
            "heartbeat.intervall is not a known key; [heartbeat] takes interval, timeout "
            "(did you mean interval?)",
        ),
        ("[deadline]\nmodel_call = 1", "deadline is not a known key; the top level takes"),
        ("[tools]\npolicies = {}", "tools.policies is not a known key; [tools] takes modules,"),
        ("[model]\nmodel = 'x'", "model.model is not a known key; [model] takes name, max_tokens"),
        ("source = '/x'", "source is not a known key"),
    ],
)
def test_unknown_keys_are_refused(tmp_path: Path, text: str, expected: str) -> None:
    assert expected in _error(_write(tmp_path, text + "\n"))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("heartbeat = 3", "heartbeat must be a table ([heartbeat]), got 3"),
        ("[tools]\npolicy = 'hold'", 'tools.policy must be a table ([tools.policy]), got "hold"'),
        ("[model]\nname = 5", "model.name must be a name such as"),
        ("[model]\nname = ''", 'model.name must be a name such as "claude-sonnet-5-5", got ""'),
        ("[model]\nname = ' x '", "model.name must be a name"),
        ("spool = 5", "spool must be the path of a folder, got 5"),
        ("spool = ''", 'spool must be the path of a folder, got ""'),
        ("spool = 1979-05-27", "spool must be the path of a folder, got a date/time"),
        ("[tools]\nmodules = 'acme.tools'", "tools.modules must be an array of module names"),
    ],
)
def test_wrong_types_are_refused(tmp_path: Path, text: str, expected: str) -> None:
    assert expected in _error(_write(tmp_path, text + "\n"))


@pytest.mark.parametrize("bad", ["my-tools", "1tools", "acme..tools", "acme.class", "", "a b", "5"])
def test_tool_modules_must_be_module_names(tmp_path: Path, bad: str) -> None:
    value = bad if bad == "5" else f'"{bad}"'
    message = _error(_write(tmp_path, f'[tools]\nmodules = ["ok.module", {value}]\n'))

    assert 'tools.modules[1] must be a Python module name such as "mypackage.tools", got' in message


@pytest.mark.parametrize("bad", ['"skip"', '"Rerun"', "true", "1"])
def test_tool_policy_is_rerun_or_hold(tmp_path: Path, bad: str) -> None:
    path = _write(tmp_path, f"[tools.policy]\nrun_command = {bad}\n")

    assert 'tools.policy.run_command must be "rerun" or "hold", got ' in _error(path)


@pytest.mark.parametrize("bad", ['"on"', '"Auto"', '""', "true", "1"])
def test_the_sandbox_is_auto_required_or_off(tmp_path: Path, bad: str) -> None:
    path = _write(tmp_path, f"[tools]\nsandbox = {bad}\n")
    assert 'tools.sandbox must be "auto", "required" or "off", got ' in _error(path)


@pytest.mark.parametrize("bad", ['"false"', "0", "1", '"no"'])
def test_the_network_is_true_or_false(tmp_path: Path, bad: str) -> None:
    path = _write(tmp_path, f"[tools]\nnetwork = {bad}\n")
    assert "tools.network must be true or false, got " in _error(path)


@pytest.mark.parametrize(
    ("text", "processes", "memory"),
    [
        ("", 512, 2 * 1024**3),
        ('max_processes = 64\nmax_memory = "512M"', 64, 512 * 1024**2),
        ('max_memory = "3g"', 512, 3 * 1024**3),
        ("max_memory = 1073741824", 512, 1024**3),
    ],
)
def test_a_task_has_a_process_and_a_memory_bound(
    tmp_path: Path, text: str, processes: int, memory: int
) -> None:
    tools = load_config(_write(tmp_path, f"[tools]\n{text}\n"), environ={}).tools
    assert (tools.max_processes, tools.max_memory) == (processes, memory)


@pytest.mark.parametrize("bad", ["0", "15", '"512"', "true", "1.5"])
def test_max_processes_is_a_whole_number_of_at_least_16(tmp_path: Path, bad: str) -> None:
    path = _write(tmp_path, f"[tools]\nmax_processes = {bad}\n")
    assert "tools.max_processes must be a whole number of at least 16 (" in _error(path)


@pytest.mark.parametrize("bad", ['"2 GB"', '"lots"', '"128M"', "1024", "true", "2.5", '"-1G"'])
def test_max_memory_is_bytes_or_a_size(tmp_path: Path, bad: str) -> None:
    path = _write(tmp_path, f"[tools]\nmax_memory = {bad}\n")
    message = _error(path)
    assert (
        'tools.max_memory must be a number of bytes or a size such as "2G" (K, M, G, T: ' in message
    )
    assert "of at least 256M, got " in message


def test_a_tool_policy_names_a_possible_tool(tmp_path: Path) -> None:
    message = _error(_write(tmp_path, '[tools.policy]\n"run command" = "hold"\n'))

    assert 'tools.policy."run command" is not a tool name' in message


def test_invalid_toml_gives_the_position(tmp_path: Path) -> None:
    message = _error(_write(tmp_path, "max_workers = 8\n[heartbeat\n"))

    assert "is not valid TOML" in message
    assert "line 2" in message


def test_a_file_that_is_not_utf8_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "agentd.toml"
    path.write_bytes(b'[model]\nname = "caf\xe9"\n')

    assert "UTF-8" in _error(path)


def test_long_values_are_shortened_in_messages(tmp_path: Path) -> None:
    message = _error(_write(tmp_path, f'[tools.policy]\nx = "{"y" * 500}"\n'))

    assert len(message) < len(str(tmp_path)) + 150


# -- the default document --------------------------------------------------------------


def test_default_text_parses_to_the_default_document() -> None:
    assert tomllib.loads(default_config_text()) == default_config_document()


def test_shipped_config_is_the_default_text() -> None:
    """config/agentd.toml is what `agentd init` writes; regenerate it when defaults change."""
    assert SHIPPED.read_text() == default_config_text()


def test_shipped_config_loads_to_the_defaults() -> None:
    config = load_config(SHIPPED, environ={})

    assert _without_source(config) == Config()
    assert config.source == SHIPPED


def test_init_document_round_trips(tmp_path: Path) -> None:
    path = _write(tmp_path, default_config_text())

    assert _without_source(load_config(path, environ={})) == Config()


def test_every_key_of_the_default_text_is_documented() -> None:
    lines = default_config_text().splitlines()
    for i, line in enumerate(lines):
        if line and not line.startswith("#"):
            assert lines[i - 1].startswith("#"), f"no comment above {line!r}"


def test_the_commented_examples_are_valid(tmp_path: Path) -> None:
    text = default_config_text().replace('# spool = "', 'spool = "')
    text = text.replace('# append_file = "rerun"', 'append_file = "rerun"')
    text = text.replace('# run_command = "hold"', 'run_command = "hold"')

    config = load_config(_write(tmp_path, text), environ={})

    assert config.spool == Path("/var/lib/agentd")
    assert dict(config.tools.policy) == {"append_file": "rerun", "run_command": "hold"}


def test_a_non_default_config_round_trips_through_its_document(tmp_path: Path) -> None:
    config = Config(
        spool=Path("/srv/agentd"),
        max_workers=2,
        heartbeat=HeartbeatConfig(interval=0.25, timeout=3.0),
        restart=dataclasses.replace(RestartConfig(), crash_loop_limit=2),
        tools=ToolsConfig(modules=("acme.tools",), policy={"run_command": "rerun"}),
    )
    path = _write(tmp_path, tomli_w.dumps(config_document(config)))

    loaded = load_config(path, environ={})

    assert _without_source(loaded) == config


def test_config_changes_names_every_key_that_differs_and_nothing_else(tmp_path: Path) -> None:
    path = tmp_path / "agentd.toml"
    path.write_text('max_workers = 3\n[tools.policy]\nrun_command = "rerun"\n')
    new, data = read_config(path)
    assert data == path.read_bytes()  # the bytes the daemon copies for its workers
    assert config_changes(Config(), Config()) == []
    assert config_changes(Config(), new) == ["max_workers", "tools.policy"]
    assert (
        config_changes(new, dataclasses.replace(new, source=None)) == []
    )  # where it came from: no key
    assert read_config(None, environ={}) == (Config(), None)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[context]\ncompact_at = 1", "context.compact_at must be a fraction between 0 and 1"),
        ("[context]\ncompact_at = 0", "context.compact_at must be a fraction between 0 and 1"),
        ("[context]\ncompact_at = 1.5", "context.compact_at must be a fraction between 0 and 1"),
        ('[context]\ncompact_at = "0.8"', "context.compact_at must be a fraction"),
        ("[context]\nkeep_turns = -1", "context.keep_turns must be a whole number of at least 0"),
        ("[context]\nkeep_turns = 1.5", "context.keep_turns must be a whole number of at least 0"),
        ("[context]\nwindow = 0", "context.window must be a whole number of at least 1"),
        (
            "[context]\nwindow = 4096",
            "context.window must be a number of tokens greater than model.max_tokens (4096)",
        ),
        (
            "[model]\nmax_tokens = 300000",
            "context.window must be a number of tokens greater than model.max_tokens (300000)",
        ),
        ('[context]\nstrategy = "auto"', 'context.strategy must be "client" or "server"'),
        ("[context]\ninstructions = 1", "context.instructions must be a string"),
    ],
)
def test_context_values_that_make_no_sense_are_refused(
    tmp_path: Path, text: str, expected: str
) -> None:
    message = _error(_write(tmp_path, text + "\n"))

    assert expected in message
    assert "\n" not in message


def test_the_window_left_out_is_the_model_family_s(tmp_path: Path) -> None:
    context = load_config(_write(tmp_path, "[context]\ncompact_at = 0.5\n")).context

    assert context.window is None
    assert context.window_for("claude-sonnet-5-5") == 200_000
    assert context.window_for("claude-2.0") == context.window_for("claude-instant-1.2") == 100_000
    assert context.threshold_for("claude-2.0") == 50_000
    assert context.threshold == 100_000
    set_one = load_config(_write(tmp_path, "[context]\nwindow = 1000000\n")).context
    assert set_one.window_for("claude-2.0") == 1_000_000


def test_a_model_family_s_window_too_small_for_max_tokens_is_refused(tmp_path: Path) -> None:
    message = _error(_write(tmp_path, '[model]\nname = "claude-2.0"\nmax_tokens = 150000\n'))

    assert (
        "context.window must be a number of tokens greater than model.max_tokens (150000), "
        "got the window of claude-2.0, 100000"
    ) in message


def test_context_keys_are_read(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "[model]\nmax_tokens = 100\n[context]\nwindow = 1000\ncompact_at = 0.5\n"
        'keep_turns = 0\ninstructions = "Keep ids."\n',
    )
    context = load_config(path).context

    assert (context.window, context.compact_at, context.keep_turns) == (1000, 0.5, 0)
    assert (context.threshold, context.instructions, context.strategy) == (
        500,
        "Keep ids.",
        "client",
    )


@pytest.mark.parametrize("strategy", ["client", "server"])
def test_both_context_strategies_are_accepted(tmp_path: Path, strategy: str) -> None:
    path = _write(tmp_path, f'[context]\nstrategy = "{strategy}"\n')
    assert load_config(path).context.strategy == strategy


# -- the shared store (docs/design.md section 10) ------------------------------------------------


def test_the_store_node_and_lease_are_read(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        'store = "postgresql://agentd@db.example.com/agentd"\nnode = "web-1"\n'
        "[cluster]\nlease = 7.5\n",
    )
    config = load_config(path)
    assert config.store == "postgresql://agentd@db.example.com/agentd"
    assert config.node == "web-1"
    assert config.cluster.lease == 7.5
    assert Config().store is None and Config().node is None and Config().cluster.lease == 10.0


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://agentd:secret@db/agentd",
        "postgres://agentd:s%40cret@db:5432/agentd",
        "postgresql://db/agentd?user=agentd&password=secret",
    ],
)
def test_a_store_url_with_a_password_is_refused(tmp_path: Path, url: str) -> None:
    message = _error(_write(tmp_path, f'store = "{url}"\n'))
    assert "store" in message and "PGPASSFILE" in message
    assert "secret" not in message and "s%40cret" not in message


@pytest.mark.parametrize("bad", ['"mysql://db/x"', '""', "3"])
def test_a_store_must_be_a_postgresql_url(tmp_path: Path, bad: str) -> None:
    assert "postgresql:// URL" in _error(_write(tmp_path, f"store = {bad}\n"))


@pytest.mark.parametrize("bad", ['"a b"', '"-x"', '""', '"x/y"'])
def test_a_node_name_is_letters_digits_dots_dashes(tmp_path: Path, bad: str) -> None:
    assert "node" in _error(_write(tmp_path, f"node = {bad}\n"))


@pytest.mark.parametrize("lease", ["0.5", "1.5"])
def test_a_lease_must_outlast_two_heartbeats(tmp_path: Path, lease: str) -> None:
    text = f"[heartbeat]\ninterval = 1.0\n[cluster]\nlease = {lease}\n"
    assert "twice heartbeat.interval" in _error(_write(tmp_path, text))


# -- approvals (docs/guides/tools.md) ----------------------------------------------


@pytest.mark.parametrize(
    ("given", "seconds", "shown"),
    [
        ("90", 90.0, "90s"),
        ("1.5", 1.5, "1.5s"),
        ('"90s"', 90.0, "90s"),
        ('"30m"', 1800.0, "30m"),
        ('"90m"', 5400.0, "90m"),
        ('"24h"', 86400.0, "1d"),
        ('"1h"', 3600.0, "1h"),
        ('"30d"', 2592000.0, "30d"),
        ('"0.5h"', 1800.0, "30m"),
        ("3600", 3600.0, "1h"),
    ],
)
def test_an_approval_period_is_seconds_or_a_string_with_a_unit(
    tmp_path: Path, given: str, seconds: float, shown: str
) -> None:
    path = _write(tmp_path, f"[approvals]\nexpire_after = {given}\nask_timeout = {given}\n")
    approvals = load_config(path, environ={}).approvals
    assert approvals.expire_after == approvals.ask_timeout == seconds
    assert parse_period(tomllib.loads(f"v = {given}")["v"]) == seconds
    assert period_text(seconds) == shown


@pytest.mark.parametrize("bad", ["0", "-5", '"5"', '"1w"', '"h"', '"-1h"', "true", '""', "nan"])
def test_an_approval_period_that_is_no_period_is_refused(tmp_path: Path, bad: str) -> None:
    path = _write(tmp_path, f"[approvals]\nask_timeout = {bad}\n")
    assert "approvals.ask_timeout must be a number of seconds greater than 0 or a period" in (
        _error(path)
    )


def test_approvals_never_expire_and_nothing_is_asked_by_default(tmp_path: Path) -> None:
    config = load_config(_write(tmp_path, ""), environ={})
    assert config.approvals.expire_after is None and config.approvals.ask_timeout is None
    assert config.tools.ask == () and config.tools.ask_effects == ()


def test_the_tools_asked_about_are_globs_and_effect_classes(tmp_path: Path) -> None:
    text = '[tools]\nask = ["run_command", "mcp__git__*"]\nask_effects = ["unsafe"]\n'
    tools = load_config(_write(tmp_path, text), environ={}).tools
    assert tools.ask == ("run_command", "mcp__git__*") and tools.ask_effects == ("unsafe",)
    assert "tools.ask[0] must be a tool name or a glob" in _error(
        _write(tmp_path, '[tools]\nask = ["a b"]\n')
    )
    assert "tools.ask_effects must be an array of effect classes" in _error(
        _write(tmp_path, '[tools]\nask_effects = ["risky"]\n')
    )
