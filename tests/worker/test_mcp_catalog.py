"""The pure half of MCP tools (docs/design.md section 11): the names the model sees, the
globs that offer tools, where an effect class comes from, and ``[mcp.servers]`` checks."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from worker.config import load_config
from worker.errors import ConfigError, TaskSpecError
from worker.mcp import catalog
from worker.mcp.catalog import EffectFrom, effect_of, offered, remote_tools, with_policy
from worker.mcp.naming import API_TOOL_NAME, model_name, servers_reached
from worker.mcp.settings import McpServer
from worker.tools.tool import Effect

# -- names ----------------------------------------------------------------------------


def test_a_valid_name_is_kept() -> None:
    assert model_name("git", "git_status") == "mcp__git__git_status"


def test_a_name_the_api_refuses_gets_its_valid_prefix_and_a_hash() -> None:
    tool = "get weather/forecast"
    mapped = model_name("weather", tool)
    digest = hashlib.sha256(tool.encode()).hexdigest()[:6]
    assert mapped == f"mcp__weather__get_{digest}"
    assert API_TOOL_NAME.fullmatch(mapped)


def test_a_long_name_is_cut_to_fit_64_characters() -> None:
    server = "a" * 32
    tool = "x" * 80
    mapped = model_name(server, tool)
    assert len(mapped) == 64
    assert API_TOOL_NAME.fullmatch(mapped)
    assert mapped.startswith(f"mcp__{server}__xxx")
    assert mapped.endswith("_" + hashlib.sha256(tool.encode()).hexdigest()[:6])
    assert model_name(server, "x" * 81) != mapped  # distinct names stay distinct


def test_servers_reached_by_patterns() -> None:
    servers = ["git", "github", "time"]
    assert servers_reached(["mcp__git__*"], servers) == ["git"]
    assert servers_reached(["mcp__*"], servers) == servers
    assert servers_reached(["mcp__git*"], servers) == ["git", "github"]
    assert servers_reached(["*", "read_file"], servers) == []  # "*" names no server's tool
    assert servers_reached(["mcp__time__get_current_time"], servers) == ["time"]


# -- effect classes ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("trust", "annotations", "effects", "expected"),
    [
        (True, {"readOnlyHint": True}, {}, (Effect.READ_ONLY, EffectFrom.ANNOTATION)),
        (True, {"idempotentHint": True}, {}, (Effect.IDEMPOTENT, EffectFrom.ANNOTATION)),
        (
            True,
            {"readOnlyHint": False, "destructiveHint": True},
            {},
            (Effect.UNSAFE, EffectFrom.ANNOTATION),
        ),
        (True, None, {}, (Effect.UNSAFE, EffectFrom.DEFAULT)),
        (False, {"readOnlyHint": True}, {}, (Effect.UNSAFE, EffectFrom.DEFAULT)),
        (False, {"readOnlyHint": True}, {"t": Effect.KEYED}, (Effect.KEYED, EffectFrom.EFFECTS)),
        (True, {"readOnlyHint": True}, {"t": Effect.UNSAFE}, (Effect.UNSAFE, EffectFrom.EFFECTS)),
    ],
)
def test_effect_rules(
    trust: bool,
    annotations: dict[str, bool] | None,
    effects: dict[str, Effect],
    expected: tuple[Effect, EffectFrom],
) -> None:
    assert (
        effect_of("t", annotations, McpServer(command=("x",), trust=trust, effects=effects))
        == expected
    )


def test_a_policy_overrides_the_class_for_resume() -> None:
    assert with_policy(Effect.READ_ONLY, EffectFrom.ANNOTATION, "hold") == (Effect.UNSAFE, "policy")
    assert with_policy(Effect.UNSAFE, EffectFrom.DEFAULT, "rerun") == (Effect.IDEMPOTENT, "policy")
    assert with_policy(Effect.READ_ONLY, EffectFrom.ANNOTATION, None) == (
        Effect.READ_ONLY,
        "annotation",
    )


def test_offered_tools_follow_the_patterns() -> None:
    listing = [
        {
            "name": "git_status",
            "annotations": {"readOnlyHint": True},
            "inputSchema": {"type": "object"},
        },
        {"name": "git_commit", "inputSchema": {"type": "object", "properties": {}}},
    ]
    remote = remote_tools("git", McpServer(command=("x",), trust=True), listing)
    assert [t["effect"] for t in remote] == ["read_only", "unsafe"]
    local = ["read_file", "write_file"]
    chosen = offered(["read_*", "mcp__git__git_status"], local, remote)
    assert chosen["local"] == ["read_file"]
    assert [t["name"] for t in chosen["mcp"]] == ["mcp__git__git_status"]
    assert offered(["*"], local, remote)["mcp"] == []  # "*" never offers a server's tool
    assert len(offered(["mcp__*"], local, remote)["mcp"]) == 2


def test_patterns_that_name_nothing_are_refused() -> None:
    catalog.check_patterns(["read_*", "mcp__git__*"], ["read_file"], ["git"])
    with pytest.raises(TaskSpecError, match="unknown tool"):
        catalog.check_patterns(["teleport"], ["read_file"], ["git"])
    with pytest.raises(TaskSpecError, match="mcp__nope__x"):
        catalog.check_patterns(["mcp__nope__x"], ["read_file"], ["git"])
    with pytest.raises(TaskSpecError, match="not a tool name or glob"):
        catalog.check_patterns(["a b"], ["read_file"], [])


# -- [mcp.servers] ------------------------------------------------------------------------


def config_of(tmp_path: Path, text: str) -> object:
    path = tmp_path / "agentd.toml"
    path.write_text(text)
    return load_config(path)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[mcp.servers.Git]\ncommand = ["x"]\n', "is not a server name"),
        (f'[mcp.servers.{"a" * 33}]\ncommand = ["x"]\n', "is not a server name"),
        ('[mcp.servers.a__b]\ncommand = ["x"]\n', "is not a server name"),
        ("[mcp.servers.git]\ntrust = true\n", "command is missing"),
        ('[mcp.servers.git]\ncommand = ["x"]\nurl = "https://x.example/mcp"\n', "both given"),
        ("[mcp.servers.git]\ncommand = []\n", "non-empty array"),
        (
            '[mcp.servers.git]\ncommand = ["x"]\nbogus = 1\n',
            "mcp.servers.git.bogus is not a known key",
        ),
        ('[mcp.servers.git]\ncommand = ["x"]\ntrust = "yes"\n', "trust must be true or false"),
        ('[mcp.servers.git]\ncommand = ["x"]\ntimeout = 0\n', "timeout must be a number"),
        ('[mcp.servers.git]\ncommand = ["x"]\ntimeout = 901\n', "at most deadlines.tool_call"),
        ('[mcp.servers.git]\ncommand = ["x"]\neffects = {a = "safe"}\n', "must be one of"),
        (
            '[mcp.servers.git]\ncommand = ["x"]\nenv = {TOKEN = "hunter2hunter2"}\n',
            "literal secret",
        ),
        ('[mcp.servers.git]\ncommand = ["x"]\nenv = {A = "${cred:a b}"}\n', "not ${cred:NAME}"),
        ('[mcp.servers.git]\ncommand = ["x"]\nheaders = {A = "b"}\n', "url server only"),
        ('[mcp.servers.h]\nurl = "ftp://x"\n', "http:// or https:// URL"),
        ('[mcp.servers.h]\nurl = "https://u:p@x.example/"\n', "user or password"),
        (
            '[mcp.servers.h]\nurl = "https://x.example/mcp"\n'
            'headers = {Authorization = "Bearer abcdefghijklmnopqrstuvwxyz0123456789"}\n',
            "literal secret",
        ),
        ("[mcp]\nserver = 1\n", "mcp.server is not a known key"),
        ('[tools]\ndefault = ["a b"]\n', "tools.default[0] must be a tool name or a glob"),
    ],
)
def test_bad_server_tables_are_one_line_errors(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        config_of(tmp_path, text)
    assert message in str(raised.value)
    assert "\n" not in str(raised.value)
    assert str(tmp_path / "agentd.toml") in str(raised.value)


def test_a_server_table_as_the_contract_writes_it(tmp_path: Path) -> None:
    config = load_config(
        _written(
            tmp_path,
            """
[tools]
default = ["read_file", "mcp__git__*"]
network = false

[mcp.servers.git]
command = ["mcp-server-git", "--repository", "."]
env = {GIT_AUTHOR_NAME = "agent", TOKEN = "${cred:git_token}"}
trust = true
effects = {git_commit = "unsafe"}
timeout = 60

[mcp.servers.tracker]
url = "https://mcp.example.com/mcp"
headers = {Authorization = "Bearer ${cred:example_token}"}
""",
        )
    )
    git = config.mcp.servers["git"]
    assert git.command == ("mcp-server-git", "--repository", ".")
    assert git.trust and git.effects == {"git_commit": Effect.UNSAFE}
    assert git.timeout == 60 and git.network is False  # [tools] network's default
    assert git.credentials() == ["git_token"]
    tracker = config.mcp.servers["tracker"]
    assert tracker.timeout == config.deadlines.tool_call and not tracker.trust
    assert config.tools.default == ("read_file", "mcp__git__*")


def _written(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "agentd.toml"
    path.write_text(text)
    return path
