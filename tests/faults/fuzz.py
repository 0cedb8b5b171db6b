"""Bad input, fuzzed with hypothesis, against every parser agentd has; and a daemon on a
spool full of garbage.

For each parser, every example must end in the parser's own one-line error (an
``AgentdError``) or be accepted; a *crash* is any other exception, a *multi-line error*
is an ``AgentdError`` whose message spans lines:

* journal bytes: ``worker.store.journal.scan`` on random bytes and on real journals truncated,
  bit-flipped and spliced (an accepted record must be an original record, unchanged);
* snapshot bytes: the worker's ``_load_snapshot`` and ``open`` (a bad snapshot is a
  cache miss: the state must then be the full replay of the journal);
* task specs: ``TaskSpec.from_json`` and ``TaskDir.load_spec``;
* scripts: ``validate_script``, then every reply of an accepted script (tool_use ids
  must be valid and unique, or the transcript could not be paired);
* config TOML: ``load_config`` on random text, mutated default files and random
  documents of the right shape;
* decision files: the worker applying a garbage decision to a held call: the task
  stays held and no record is changed (no decision or result recorded);
* CLI arguments: ``supervisor.cli.main`` with random argv against a real spool: exit code
  in {0, 1, 2, 3, 78}, never an uncaught exception, exactly one stderr line on failure.

Then a real daemon on a spool whose tasks have garbage spec, state, journal, heartbeat,
exit, script, snapshot, lock and decision files (and junk that is no task at all): it must
keep running, settle every bad task (failed with a reason, or done/held where the
garbage was only a cache), finish the good task, and print no traceback.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from unittest import mock

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from supervisor import cli
from tests.faults.common import (
    STABLE_ENV,
    clone_task,
    final_state,
    make_task,
    mixed_plan,
    reap_spool,
    records,
    stop_before_record,
    stopwatch,
)
from tests.faults.report import Figure
from tests.support import REPO, make_loop, reply, scene, scripted_task, text, tool_use, worker_env
from worker.config import default_config_text, load_config
from worker.errors import AgentdError
from worker.models.base import ModelRequest
from worker.models.scripted import ScriptedModel, load_script, validate_script
from worker.spool import CALL_ID, Spool, TaskDir, TaskSpec
from worker.state import SNAPSHOT_MAGIC, seal_snapshot
from worker.store import replay
from worker.store.journal import encode, scan

FAULT = "fuzz"
EXIT_CODES = {0, 1, 2, 3, 78}

# -- strategies ---------------------------------------------------------------------------

scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()
    | st.text(max_size=12)
)
json_values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=10,
)

T = TypeVar("T")


def mutated(base: dict[str, Any]) -> st.SearchStrategy[Any]:
    """``base`` with keys replaced by random values, deleted, or added."""

    @st.composite
    def build(draw: st.DrawFn) -> Any:
        data = json.loads(json.dumps(base))
        for _ in range(draw(st.integers(1, 3))):
            target = data
            path = draw(st.lists(st.integers(0, 10**6), min_size=1, max_size=4))
            for step in path[:-1]:
                if isinstance(target, dict) and target:
                    value = target[sorted(target)[step % len(target)]]
                elif isinstance(target, list) and target:
                    value = target[step % len(target)]
                else:
                    break
                if not isinstance(value, dict | list):
                    break
                target = value
            how = draw(st.sampled_from(["replace", "delete", "add"]))
            if isinstance(target, dict):
                keys = sorted(target)
                if how == "add" or not keys:
                    target[draw(st.text(max_size=8))] = draw(json_values)
                else:
                    key = keys[path[-1] % len(keys)]
                    if how == "delete":
                        del target[key]
                    else:
                        target[key] = draw(json_values)
            elif isinstance(target, list) and target:
                i = path[-1] % len(target)
                if how == "delete":
                    del target[i]
                else:
                    target[i] = draw(json_values)
        return data

    return build()


def explore(
    strategy: st.SearchStrategy[Any], check: Callable[[Any], None], n: int, seed: int
) -> None:
    """Run ``check`` on ``n`` examples; ``check`` records what it finds and never raises."""

    @settings(
        max_examples=n,
        deadline=None,
        database=None,
        phases=(Phase.generate,),
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def prop(value: Any) -> None:
        check(value)

    hypothesis_seed(seed)(prop)()


# -- tallies ------------------------------------------------------------------------------


@dataclass
class Tally:
    parser: str
    examples: int = 0
    crashes: list[str] = field(default_factory=list)
    multiline: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)  # records changed / bad input taken
    changed_name: str = "records changed"

    def run(self, fn: Callable[[], T], sample: Any) -> T | None:
        """Call ``fn`` and return what it did; tally an AgentdError's lines and any other
        exception as a crash (then None)."""
        self.examples += 1
        try:
            return fn()
        except AgentdError as exc:
            if len(str(exc).splitlines()) != 1:
                self.multiline.append(f"{str(exc)!r:.200} on {sample!r:.120}")
        except Exception as exc:
            self.crashes.append(f"{type(exc).__name__}: {exc!s:.160} on {sample!r:.160}")
        return None

    def figures(self) -> list[Figure]:
        name = self.parser
        out = [
            Figure(FAULT, f"{name}: examples", self.examples, violation=not self.examples),
            Figure(FAULT, f"{name}: crashes", len(self.crashes), violation=bool(self.crashes)),
            Figure(FAULT, f"{name}: multi-line errors", len(self.multiline), bool(self.multiline)),
            Figure(FAULT, f"{name}: {self.changed_name}", len(self.changed), bool(self.changed)),
        ]
        for what in (self.crashes, self.multiline, self.changed):
            if what:
                out.append(Figure(FAULT, f"{name}: first", what[0], violation=True))
                break
        return out


# -- journal ------------------------------------------------------------------------------


def fuzz_journal(n: int, seed: int, sample: list[dict[str, Any]]) -> Tally:
    tally = Tally("journal bytes")
    frames = [encode(r) for r in sample]
    whole = b"".join(frames)

    @st.composite
    def damaged(draw: st.DrawFn) -> tuple[str, bytes]:
        data = bytearray(whole)
        how = draw(st.sampled_from(["cut", "flip", "insert", "overwrite", "random"]))
        if how == "cut":
            return how, bytes(data[: draw(st.integers(0, len(data)))])
        if how == "flip":
            for _ in range(draw(st.integers(1, 4))):
                i = draw(st.integers(0, len(data) - 1))
                data[i] ^= 1 << draw(st.integers(0, 7))
        elif how == "insert":
            i = draw(st.integers(0, len(data)))
            data[i:i] = draw(st.binary(min_size=1, max_size=16))
        elif how == "overwrite":
            i = draw(st.integers(0, len(data) - 1))
            chunk = draw(st.binary(min_size=1, max_size=16))
            data[i : i + len(chunk)] = chunk
        else:
            return how, draw(st.binary(max_size=256))
        return how, bytes(data)

    def check(example: tuple[str, bytes]) -> None:
        how, data = example
        found = tally.run(lambda: scan(data), example)
        if found is None:
            return
        got = [r for r, _ in found.records]
        if how == "random":
            return
        if any(r not in sample for r in got):
            tally.changed.append(f"{how}: accepted a record that was never written")
        elif how == "cut" and got != sample[: len(got)]:
            tally.changed.append("cut: the records read are not a prefix")

    explore(damaged(), check, n, seed)
    return tally


# -- snapshot -----------------------------------------------------------------------------


def _flip_bit(data: bytes, bit: int) -> bytes:
    at = bit // 8
    return data[:at] + bytes([data[at] ^ (1 << bit % 8)]) + data[at + 1 :]


def fuzz_snapshot(n: int, seed: int, task: TaskDir) -> Tally:
    tally = Tally("snapshot bytes", changed_name="states not the journal's")
    truth = scene(final_state(task))
    loop = make_loop(task)
    loop.open()
    good = loop.state.compact().to_snapshot(loop.journal.cursor.position if loop.journal else 0)
    loop.close()
    sealed = seal_snapshot(good)

    strategy = (  # "sealed": past the checksum, so the example reaches the fields' parsing
        st.binary(max_size=200).map(lambda b: ("bytes", b))
        | json_values.map(lambda v: ("json", json.dumps(v).encode()))
        | st.binary(max_size=200).map(lambda b: ("magic", SNAPSHOT_MAGIC + b))
        | st.integers(0, len(sealed) * 8 - 1).map(lambda i: ("flipped", _flip_bit(sealed, i)))
        | mutated(good).map(lambda v: ("sealed", seal_snapshot(v)))
    )

    def check(example: tuple[str, bytes]) -> None:
        kind, data = example
        task.snapshot.write_bytes(data)
        loop = make_loop(task)
        try:
            loaded = tally.run(  # a tuple, so that only a crash is None
                lambda: (
                    replay.latest_snapshot(loop.store, task.id, loop.recorder.snapshot_ignored),
                ),
                example,
            )
            if loaded is None:
                return
            tally.examples -= 1  # one example, two calls
            opened = tally.run(loop.open, example)
            if opened is None:
                return
            (snapshot,) = loaded
            offset = snapshot.cursor.position if snapshot is not None else 0
            if kind == "flipped" and offset != 0:
                tally.changed.append(f"a snapshot with a flipped bit was trusted: {data!r:.100}")
            if offset == 0 and scene(loop.state) != truth:
                tally.changed.append(
                    f"a snapshot that was ignored changed the state: {data!r:.100}"
                )
        finally:
            loop.close()

    explore(strategy, check, n, seed)
    task.snapshot.unlink(missing_ok=True)
    return tally


# -- specs and scripts ---------------------------------------------------------------------


def fuzz_spec(n: int, seed: int, task: TaskDir) -> Tally:
    tally = Tally("task specs", changed_name="bad specs accepted")
    good = task.load_spec().to_json()
    original = task.spec.read_bytes()
    strategy = (
        json_values.map(lambda v: ("json", v))
        | mutated(good).map(lambda v: ("mutated", v))
        | st.binary(max_size=120).map(lambda b: ("bytes", b))
    )

    def check(example: tuple[str, Any]) -> None:
        how, value = example
        if how == "bytes":
            task.spec.write_bytes(value)
            tally.run(task.load_spec, example)
            return
        spec = tally.run(lambda: TaskSpec.from_json(value, where="spec.json"), example)
        if isinstance(spec, TaskSpec) and not (
            isinstance(spec.prompt, str) and isinstance(spec.max_turns, int) and spec.max_turns >= 1
        ):
            tally.changed.append(f"accepted {value!r:.160}")

    explore(strategy, check, n, seed)
    task.spec.write_bytes(original)
    return tally


GOOD_SCRIPT = {
    "responses": [
        reply(text("a"), tool_use("write_file", path="a.txt", content="x")),
        reply(tool_use("append_file", call_id="toolu_x1", path="l.txt", content="y")),
        reply(text("done"), usage={"input_tokens": 3, "output_tokens": 2}),
    ]
}


USAGE_KEYS = ["input_tokens", "output_tokens", "cache_creation_input_tokens", "x"]
IDS = ["toolu_a", "toolu_s00000_0", "toolu_s00001_0", "bad id", "", "x" * 200]


@st.composite
def script_shapes(draw: st.DrawFn) -> dict[str, Any]:
    """A valid script with one to three wrong values where they hurt."""
    responses: list[dict[str, Any]] = []
    for _ in range(draw(st.integers(1, 3))):
        blocks: list[Any] = [{"type": "text", "text": "t"}]
        for _ in range(draw(st.integers(0, 2))):
            blocks.append({"type": "tool_use", "name": "write_file", "input": {"path": "a"}})
        responses.append({"content": blocks})
    for _ in range(draw(st.integers(1, 3))):
        response = draw(st.sampled_from(responses))
        where = draw(st.sampled_from(["usage", "id", "id", "delay", "stop_reason", "block"]))
        uses = [
            b for b in response["content"] if isinstance(b, dict) and b.get("type") == "tool_use"
        ]
        if where == "usage":
            response["usage"] = {draw(st.sampled_from(USAGE_KEYS)): draw(json_values)}
        elif where == "id" and uses:
            draw(st.sampled_from(uses))["id"] = draw(st.sampled_from(IDS) | json_values)
        elif where == "delay":
            response["delay"] = draw(scalars)
        elif where == "stop_reason":
            response["stop_reason"] = draw(st.sampled_from(["end_turn", "max_tokens"]) | scalars)
        elif where == "block":
            i = draw(st.integers(0, len(response["content"]) - 1))
            response["content"][i] = draw(json_values)
    return {"responses": responses}


def fuzz_script(n: int, seed: int, root: Path) -> Tally:
    tally = Tally("scripts", changed_name="scripts accepted that break the loop")
    path = root / "script.json"
    request = ModelRequest(model="m", max_tokens=10, messages=[])
    strategy = (
        json_values.map(lambda v: ("json", v))
        | mutated(GOOD_SCRIPT).map(lambda v: ("mutated", v))
        | script_shapes().map(lambda v: ("shaped", v))
        | st.binary(max_size=120).map(lambda b: ("bytes", b))
    )

    def replies(responses: list[dict[str, Any]]) -> list[str]:
        model = ScriptedModel(responses, sleep=lambda s: None)
        ids = []
        for k in range(len(responses)):
            out = model.complete(request, turn_index=k)
            json.dumps(out.content)
            ids += [b["id"] for b in out.content if b.get("type") == "tool_use"]
        return ids

    def check(example: tuple[str, Any]) -> None:
        how, value = example
        if how == "bytes":
            path.write_bytes(value)
            tally.run(lambda: load_script(path), example)
            return
        responses = tally.run(lambda: validate_script(value, "script.json"), example)
        if responses is None:
            return
        tally.examples -= 1
        ids = tally.run(lambda: replies(responses), example)
        if ids is None:
            return
        bad = [i for i in ids if not isinstance(i, str) or not CALL_ID.fullmatch(i)]
        if bad or len(set(ids)) != len(ids):
            tally.changed.append(f"tool_use ids {ids!r:.100} from {value!r:.160}")

    explore(strategy, check, n, seed)
    return tally


# -- config -------------------------------------------------------------------------------

toml_scalars = (
    st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats()
    | st.text(max_size=12)
)
TOP_KEYS = ["spool", "max_workers", "heartbeat", "deadlines", "restart", "model", "tools"]
TOP_KEYS += ["metrics", "context"]
SUB_KEYS = {
    "heartbeat": ["interval", "timeout"],
    "deadlines": ["model_call", "tool_call"],
    "restart": ["backoff_initial", "backoff_max", "crash_loop_limit", "stop_grace"],
    "model": ["name", "max_tokens"],
    "tools": ["modules", "policy"],
    "metrics": ["listen"],
    "context": ["window", "compact_at", "keep_turns", "strategy", "instructions"],
}


@st.composite
def config_documents(draw: st.DrawFn) -> dict[str, Any]:
    doc: dict[str, Any] = {}
    for key in draw(st.lists(st.sampled_from(TOP_KEYS) | st.text(max_size=6), max_size=5)):
        if key in SUB_KEYS and draw(st.booleans()):
            table: dict[str, Any] = {}
            for sub in draw(
                st.lists(st.sampled_from(SUB_KEYS[key]) | st.text(max_size=6), max_size=4)
            ):
                if sub == "policy":
                    table[sub] = draw(
                        st.dictionaries(st.text(max_size=8), toml_scalars, max_size=3)
                    )
                elif sub == "modules":
                    table[sub] = draw(st.lists(toml_scalars, max_size=3) | toml_scalars)
                else:
                    table[sub] = draw(toml_scalars | st.lists(toml_scalars, max_size=2))
            doc[key] = table
        else:
            doc[key] = draw(toml_scalars | st.lists(toml_scalars, max_size=2))
    return doc


@st.composite
def mutated_config_text(draw: st.DrawFn) -> str:
    lines = default_config_text().splitlines()
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.integers(0, len(lines)))
        how = draw(st.sampled_from(["insert", "delete", "edit"]))
        if how == "insert" or not lines:
            lines.insert(i, draw(st.text(max_size=30)))
        elif how == "delete":
            del lines[min(i, len(lines) - 1)]
        else:
            j = min(i, len(lines) - 1)
            line = lines[j]
            cut = draw(st.integers(0, len(line)))
            lines[j] = line[:cut] + draw(st.text(max_size=10)) + line[cut:]
    return "\n".join(lines)


def listens(address: tuple[str, int] | None) -> bool:
    """An accepted ``metrics.listen``: off, or a host and a port a socket can bind."""
    return address is None or (bool(address[0]) and 1 <= address[1] <= 65535)


def compacts_sensibly(config: Any) -> bool:
    """An accepted ``[context]``: a window (set, or the model's) larger than max_tokens,
    a fraction of it to compact at, no negative kept turns, a known strategy."""
    context = config.context
    return (
        context.window_for(config.model.name) > config.model.max_tokens
        and 0 < context.compact_at < 1
        and context.keep_turns >= 0
        and context.strategy in ("client", "server")
        and isinstance(context.instructions, str)
    )


def fuzz_config(n: int, seed: int, root: Path) -> Tally:
    import tomli_w

    tally = Tally("config TOML", changed_name="bad configs accepted")
    path = root / "agentd.toml"

    def dump(doc: dict[str, Any]) -> str | None:
        try:
            return tomli_w.dumps(doc)
        except (TypeError, ValueError):
            return None

    strategy = (
        st.text(max_size=200).map(lambda t: ("text", t))
        | mutated_config_text().map(lambda t: ("mutated", t))
        | config_documents().map(lambda d: ("document", dump(d)))
        | st.binary(max_size=80).map(lambda b: ("bytes", b))
    )

    def check(example: tuple[str, Any]) -> None:
        _, value = example
        if value is None:
            return
        if isinstance(value, bytes):
            path.write_bytes(value)
        else:
            path.write_text(value, errors="surrogatepass")
        config = tally.run(lambda: load_config(path, environ={}), example)
        if config is not None and not (
            0 < config.heartbeat.interval < config.heartbeat.timeout
            and config.max_workers >= 1
            and listens(config.metrics.address)
            and compacts_sensibly(config)
        ):
            tally.changed.append(f"accepted {value!r:.160}")

    explore(strategy, check, n, seed)
    return tally


# -- decision files -----------------------------------------------------------------------


def held_task(root: Path) -> tuple[TaskDir, Path]:
    """A task held on a dangling append_file call, and the path of its decision file."""
    responses = [
        reply(tool_use("append_file", path="log.txt", content="once\n")),
        reply(text("ok")),
    ]
    spool = Spool(root / "spool").ensure()
    task = scripted_task(spool, responses, name="held")
    stop_before_record(task, 3)  # header, turn, intent: the tool ran, its result is lost
    loop = make_loop(task)
    outcome = loop.run()
    loop.close()
    if outcome.state != "held":
        raise RuntimeError(f"the decision-file task did not hold: {outcome}")
    state = final_state(task)
    call = state.dangling()[0]
    return task, task.decision_file(str(call.key), call.attempt)


def fuzz_decisions(n: int, seed: int, root: Path) -> Tally:
    tally = Tally("decision files", changed_name="records changed")
    task, path = held_task(root)
    path.parent.mkdir(mode=0o700, exist_ok=True)
    valid = {"rerun", "skip", "result"}
    strategy = (
        st.binary(max_size=120).map(lambda b: ("bytes", b))
        | json_values.filter(lambda v: not (isinstance(v, dict) and v.get("action") in valid)).map(
            lambda v: ("json", json.dumps(v).encode())
        )
        | st.dictionaries(st.text(max_size=8), json_values, max_size=3)
        .map(lambda d: {**d, "action": d.get("action", "maybe")})
        .filter(lambda d: d["action"] not in valid)
        .map(lambda d: ("object", json.dumps(d).encode()))
        | st.just(("folder", b""))
    )

    def check(example: tuple[str, bytes]) -> None:
        how, data = example
        if path.is_dir():
            path.rmdir()
        else:
            path.unlink(missing_ok=True)
        if how == "folder":
            path.mkdir()
        else:
            path.write_bytes(data)
        before = records(task)
        loop = make_loop(task)
        try:
            outcome = tally.run(loop.run, example)
        finally:
            loop.close()
        after = records(task)
        new = [r.get("k") for r in after[len(before) :]]
        if after[: len(before)] != before or any(k != "hold" for k in new):
            tally.changed.append(f"{how} decision {data!r:.100} recorded {new}")
        elif outcome is not None and outcome.state != "held":
            tally.changed.append(f"{how} decision {data!r:.100} ended the hold: {outcome}")

    explore(strategy, check, n, seed)
    return tally


# -- the command line --------------------------------------------------------------------

COMMANDS = [
    "submit", "status", "dangling", "approve-dangling", "logs", "cancel", "retry",
    "history", "rewind", "fork", "config", "stop",
]  # fmt: skip
WORDS = [
    *COMMANDS, "--prompt", "--prompt-file", "--name", "--model", "--script", "--tools",
    "--system", "--max-turns", "--workspace", "--json", "--all", "--skip", "--reason",
    "--result", "--result-file", "--to", "--at", "--yes", "--restore-workspace", "--config",
    "--log-format", "json", "console", "check", "--help", "--version", "t1", "held", "nope",
    "../x", "a/b", "/etc", "x" * 70, "bad\x00id", "-1", "0", "1", "99", "scripted", "--",
    "toolu_x1", "read_file,nope", "",
]  # fmt: skip


def _spool_option(token: str) -> bool:
    return token.startswith("--sp") and "--spool".startswith(token.split("=", 1)[0])


@contextlib.contextmanager
def _cwd(path: Path) -> Iterator[None]:
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


def fuzz_cli(n: int, seed: int, root: Path) -> Tally:
    tally = Tally("CLI arguments", changed_name="exit codes outside 0,1,2,3,78")
    spool = Spool(root / "cli-spool").ensure()
    done = scripted_task(spool, mixed_plan(3).responses, name="t1")
    stop_before_record(done, 10**6)
    held, _ = held_task(root / "cli-held")
    shutil.copytree(held.path, spool.tasks_dir / "held", symlinks=True)
    cwd = root / "cli-cwd"
    cwd.mkdir()
    strategy = st.lists(st.sampled_from(WORDS) | st.text(max_size=12), max_size=7)

    def check(tokens: list[str]) -> None:
        if any(_spool_option(t) for t in tokens):
            return
        argv = ["--spool", str(spool.root), *tokens]
        with (
            contextlib.suppress(Exception, SystemExit),
            contextlib.redirect_stdout(io.StringIO()),
            contextlib.redirect_stderr(io.StringIO()),
        ):
            parsed = cli.build_parser().parse_args(argv)
            if parsed.command in ("start", "demo", "init"):
                return
        out, err = io.StringIO(), io.StringIO()
        tally.examples += 1
        code: object
        try:
            with (
                _cwd(cwd),
                contextlib.redirect_stdout(out),
                contextlib.redirect_stderr(err),
                mock.patch.dict(os.environ, {"AGENTD_CONFIG": "", "AGENTD_SPOOL": ""}),
                mock.patch("time.sleep", side_effect=KeyboardInterrupt),
            ):
                code = cli.main(argv)
        except SystemExit as exc:
            code = exc.code if exc.code is not None else 0
        except BaseException as exc:
            tally.crashes.append(f"{type(exc).__name__}: {exc!s:.160} on {tokens!r:.160}")
            return
        if code not in EXIT_CODES:
            tally.changed.append(f"exit {code!r} on {tokens!r:.160}")
        lines = [line for line in err.getvalue().splitlines() if line.strip()]
        if code not in (0, None) and len(lines) != 1:
            tally.multiline.append(f"{err.getvalue()!r:.200} on {tokens!r:.160}")

    explore(strategy, check, n, seed)
    return tally


# -- a daemon on a spool of garbage -------------------------------------------------------

DAEMON_CONFIG = """\
[heartbeat]
interval = 0.2
timeout = 5.0
[restart]
backoff_initial = 0.05
backoff_max = 0.2
crash_loop_limit = 3
stop_grace = 2.0
"""
SETTLED = ("done", "failed", "held", "cancelled")
#: The owner of the spool content that is another user's.
STRANGER = 12345
#: How the daemon and status run: as root, in a user namespace that maps only root, so
#: that a file of ``STRANGER``'s is as closed to them as to a daemon run as its own user
#: (root would read it anyway); empty where that cannot be done (not root, no unshare).
AS_DAEMON: tuple[str, ...] = ()
if os.geteuid() == 0 and shutil.which("unshare"):
    _probe = ["unshare", "--user", "--map-root-user", "true"]
    if subprocess.run(_probe, capture_output=True, check=False).returncode == 0:
        AS_DAEMON = tuple(_probe[:-1])


def _garbage(rng: random.Random, size: int = 64) -> bytes:
    return bytes(rng.randrange(256) for _ in range(size))


def plant_bad_tasks(spool: Spool, rng: random.Random) -> dict[str, tuple[str, ...]]:
    """Tasks with garbage in one file each; their id -> the states they may settle in."""
    plan = mixed_plan(3)
    expect: dict[str, tuple[str, ...]] = {}

    def task(name: str, states: tuple[str, ...], **files: bytes | str | None) -> TaskDir:
        t = scripted_task(spool, plan.responses, name=name)
        for attr, content in files.items():
            target: Path = getattr(t, attr)
            if content is None:
                target.unlink(missing_ok=True)
                target.mkdir(mode=0o700)
            else:
                target.write_bytes(content if isinstance(content, bytes) else content.encode())
        expect[name] = states
        return t

    task("spec-garbage", ("failed",), spec=_garbage(rng))
    task("spec-list", ("failed",), spec="[1, 2]")
    task("spec-other-id", ("failed",), spec=json.dumps({**TaskSpec("other", "p").to_json()}))
    task("spec-folder", (), spec=None)  # no spec file: not a task (a submit cut short)
    del expect["spec-folder"]
    task("script-garbage", ("failed",), script=_garbage(rng))
    task("state-garbage", SETTLED, state=_garbage(rng))
    task(
        "state-shape", SETTLED, state=json.dumps({"state": "running", "pid": "x", "restarts": "y"})
    )
    task(
        "state-running",
        SETTLED,
        state=json.dumps({"state": "running", "pid": 1, "pid_started": 1.0}),
    )
    task("journal-garbage", ("failed", "done"), journal=_garbage(rng, 300))
    task("journal-folder", ("failed",), journal=None)
    task(
        "heartbeat-garbage",
        ("failed",),
        spec="{}",
        heartbeat=json.dumps({"turn": "x", "at": "y", "pid": "z"}),
    )
    task("heartbeat-bytes", ("done",), heartbeat=_garbage(rng))
    task("exit-garbage", ("failed",), spec=b"\xff", exit=json.dumps({"code": "x", "pid": "y"}))
    task("snapshot-garbage", ("done",), snapshot=_garbage(rng))
    task("snapshot-list", ("done",), snapshot="[]")
    task("events-garbage", ("done",), events=_garbage(rng))
    # a lock file that names no pid: pid unknown, never a daemon that cannot start
    task("lock-empty", ("done",), lock=b"")
    task("lock-garbage", ("done",), lock=b"x" + _garbage(rng))
    # a held task whose decision file is garbage: it must stay held
    held, decision = held_task(spool.root.parent / "held-src")
    shutil.copytree(held.path, spool.tasks_dir / "decision-garbage", symlinks=True)
    spec = json.loads((spool.tasks_dir / "decision-garbage" / "spec.json").read_text())
    (spool.tasks_dir / "decision-garbage" / "spec.json").write_text(
        json.dumps({**spec, "id": "decision-garbage"})
    )
    (spool.tasks_dir / "decision-garbage" / "state.json").write_text(
        json.dumps({"state": "queued"})
    )
    bad_decision = spool.tasks_dir / "decision-garbage" / decision.relative_to(held.path)
    bad_decision.parent.mkdir(mode=0o700, exist_ok=True)
    bad_decision.write_bytes(_garbage(rng))
    expect["decision-garbage"] = ("held",)
    # a file where a folder should be
    task("decisions-file", ("done",), decisions=_garbage(rng))
    task("output-folder", ("done", "failed"), output=None)
    t = task("workspace-file", ("done", "failed"))
    shutil.rmtree(t.path / "workspace", ignore_errors=True)
    (t.path / "workspace").write_bytes(_garbage(rng))
    # folders and files the daemon may not read: another user's (``STRANGER``), seen
    # from a daemon without the root's right to read anything (``AS_DAEMON``)
    if AS_DAEMON:
        for name, mode in (("foreign", 0o700), ("foreign-000", 0o000)):
            t = task(name, ("failed",))
            for path in (t.path, *t.path.iterdir()):
                os.chown(path, STRANGER, STRANGER, follow_symlinks=False)
            t.path.chmod(mode)
        t = task("foreign-state", ("failed",))
        os.chown(t.state, STRANGER, STRANGER)
        t.state.chmod(0o600)
    # junk that is no task
    (spool.tasks_dir / "not-a-folder").write_bytes(_garbage(rng))
    (spool.tasks_dir / "README").write_bytes(_garbage(rng))
    (spool.tasks_dir / "Bad..Name").mkdir()
    (spool.tasks_dir / "empty").mkdir()
    (spool.tasks_dir / ".hidden").mkdir()
    return expect


def _status(spool: Spool) -> tuple[int, dict[str, Any] | None, str]:
    done = subprocess.run(
        [
            *AS_DAEMON,
            sys.executable,
            "-m",
            "supervisor",
            "--spool",
            str(spool.root),
            "status",
            "--json",
        ],
        cwd=REPO,
        env=worker_env(STABLE_ENV),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    try:
        return done.returncode, json.loads(done.stdout), done.stderr
    except ValueError:
        return done.returncode, None, done.stderr


def daemon_on_garbage(root: Path, rng: random.Random, timeout: float) -> list[Figure]:
    name = "daemon on bad spool"
    spool = Spool(root / "daemon-spool").ensure()
    config = root / "daemon.toml"
    config.write_text(DAEMON_CONFIG)
    expect = plant_bad_tasks(spool, rng)
    scripted_task(spool, mixed_plan(3).responses, name="good")
    log = root / "daemon.log"
    cmd = [
        *AS_DAEMON,
        *(sys.executable, "-m", "supervisor", "--spool", str(spool.root), "--config", str(config)),
    ]
    with open(log, "wb") as out:
        daemon = subprocess.Popen(
            [*cmd, "--log-format", "json", "start"],
            cwd=REPO,
            env=worker_env(STABLE_ENV),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            start_new_session=True,
        )
    states: dict[str, str] = {}
    status_failures = 0
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and daemon.poll() is None:
            code, doc, _ = _status(spool)
            if code != 0 or doc is None:
                status_failures += 1
            else:
                states = {t["id"]: t["state"] for t in doc["tasks"]}
                reasons = {t["id"]: t["reason"] for t in doc["tasks"]}
                if states.get("good") == "done" and all(states.get(t) in SETTLED for t in expect):
                    break
            time.sleep(0.3)
        alive = daemon.poll() is None
        code, doc, _ = _status(spool)
        if doc is not None:
            states = {t["id"]: t["state"] for t in doc["tasks"]}
            reasons = {t["id"]: t["reason"] for t in doc["tasks"]}
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(daemon.pid, signal.SIGTERM)
        try:
            stopped = daemon.wait(timeout=15) == 0
        except subprocess.TimeoutExpired:
            stopped = False
        with contextlib.suppress(ProcessLookupError):
            os.killpg(daemon.pid, signal.SIGKILL)
        daemon.wait()
        stopped = not reap_spool(spool.root) and stopped  # no worker left behind either
    text_log = log.read_text(errors="replace")
    tracebacks = text_log.count("Traceback") + text_log.count("Exception in callback")
    stuck = sorted(t for t in expect if states.get(t) not in SETTLED)
    wrong = sorted(t for t in expect if states.get(t) in SETTLED and states[t] not in expect[t])
    no_reason = sorted(t for t in expect if states.get(t) == "failed" and not reasons.get(t))
    figures = [
        Figure(FAULT, f"{name}: bad tasks planted", len(expect)),
        Figure(FAULT, f"{name}: daemon died", int(not alive), violation=not alive),
        Figure(FAULT, f"{name}: daemon stopped cleanly", int(stopped), violation=not stopped),
        Figure(FAULT, f"{name}: tracebacks logged", tracebacks, violation=bool(tracebacks)),
        Figure(FAULT, f"{name}: status failures", status_failures, bool(status_failures)),
        Figure(
            FAULT,
            f"{name}: good task done",
            int(states.get("good") == "done"),
            violation=states.get("good") != "done",
        ),
        Figure(FAULT, f"{name}: bad tasks stuck", len(stuck), violation=bool(stuck)),
        Figure(FAULT, f"{name}: bad tasks in a wrong state", len(wrong), violation=bool(wrong)),
        Figure(FAULT, f"{name}: failed without a reason", len(no_reason), bool(no_reason)),
    ]
    details = [f"{t}={states.get(t)}" for t in stuck + wrong + no_reason]
    if tracebacks:
        at = text_log.find("Traceback")
        at = at if at >= 0 else text_log.find("Exception in callback")
        details.append(text_log[at : at + 400])
    if details:
        figures.append(Figure(FAULT, f"{name}: first", "; ".join(details), violation=True))
    return figures


# -- the campaign -------------------------------------------------------------------------


def run(quick: bool, seed: int | None = None) -> list[Figure]:
    seed = random.randrange(2**32) if seed is None else seed
    n = 100 if quick else 2000
    figures = [Figure(FAULT, "seed", seed)]
    with stopwatch() as elapsed, tempfile.TemporaryDirectory(prefix="agentd-fuzz-") as tmp:
        root = Path(tmp)
        done = make_task(root / "done", mixed_plan(3))
        stop_before_record(done, 10**6)
        sample = records(done)
        tallies = [
            fuzz_journal(n, seed, sample),
            fuzz_snapshot(n, seed, clone_task(done, root / "snap")),
            fuzz_spec(n, seed, clone_task(done, root / "spec")),
            fuzz_script(n, seed, root),
            fuzz_config(n, seed, root),
            fuzz_decisions(n, seed, root / "decisions"),
            fuzz_cli(n, seed, root),
        ]
        for tally in tallies:
            figures += tally.figures()
        figures += daemon_on_garbage(root, random.Random(seed), timeout=60 if quick else 120)
        seconds = elapsed()
    figures.append(Figure(FAULT, "runtime s", round(seconds, 1)))
    return figures
