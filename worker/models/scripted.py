"""The scripted model: an offline, deterministic backend (docs/design.md section 4).

Model call k of a task (k = the turns recorded on its live branch, so compactions do not
shift it) returns ``responses[k]`` of the script, so a resumed task continues where it
left off. A compaction's summary call returns ``summaries[j]`` for the task's j-th
compaction, or a deterministic summary naming the turns it replaces when the script has
none. The script is validated when it is loaded, with one-line errors naming the response
at fault.

A response's ``usage`` is reported as written. A response without one reports
``input_tokens`` = ceil(characters of the request / 4) (``request_tokens``: the system
prompt and the messages written as JSON), and 5 output tokens; so a transcript that
grows reports a growing size, and a compacted one its smaller size, as the API would.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from worker.errors import ModelError, TaskSpecError
from worker.models.base import JSON, ModelReply, ModelRequest, SummaryOf, Usage
from worker.store.durable import read_regular

_BLOCK_TYPES = {"text", "tool_use", "thinking"}
_CALL_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
_USAGE_KEYS = (
    "input_tokens",
    "output_tokens",
    "cache_creation_input_tokens",
    "cache_read_input_tokens",
)


def request_tokens(request: ModelRequest) -> int:
    """What a scripted response without ``usage`` reports as ``input_tokens``: the
    characters of the request (its system prompt and its messages as JSON) over 4,
    rounded up."""
    size = len(request.system or "") + len(json.dumps(list(request.messages), ensure_ascii=False))
    return math.ceil(size / 4)


def _default_id(turn_index: int, block_index: int) -> str:
    return f"toolu_s{turn_index:05d}_{block_index}"


def _validate(data: Any, where: str) -> list[JSON]:
    def bad(what: str) -> TaskSpecError:
        return TaskSpecError(f"{where}: {what}; fix the script and submit the task again.")

    if not isinstance(data, dict) or not isinstance(data.get("responses"), list):
        raise bad('the script must be a JSON object with a "responses" list')
    responses: list[JSON] = data["responses"]
    ids: set[str] = set()
    for i, response in enumerate(responses):
        at = f"responses[{i}]"
        if not isinstance(response, dict):
            raise bad(f"{at} is not an object")
        content = response.get("content")
        if not isinstance(content, list) or not content:
            raise bad(f"{at}.content must be a non-empty list of blocks")
        for j, block in enumerate(content):
            if not isinstance(block, dict) or block.get("type") not in _BLOCK_TYPES:
                raise bad(f"{at}.content[{j}] must be a text, tool_use or thinking block")
            if block["type"] == "text" and not isinstance(block.get("text"), str):
                raise bad(f"{at}.content[{j}].text must be a string")
            if block["type"] == "tool_use" and (
                not isinstance(block.get("name"), str) or not isinstance(block.get("input"), dict)
            ):
                raise bad(f"{at}.content[{j}] needs a string name and an object input")
            if block["type"] == "tool_use":
                # every tool_result must name exactly one tool_use: ids are valid and unique
                call_id = block.get("id", _default_id(i, j))
                if not isinstance(call_id, str) or not _CALL_ID.fullmatch(call_id):
                    raise bad(f"{at}.content[{j}].id must be 1 to 128 of A-Z, a-z, 0-9, _ and -")
                if call_id in ids:
                    raise bad(f"{at}.content[{j}].id {call_id!r} is used twice in the script")
                ids.add(call_id)
        delay = response.get("delay", 0)
        if (
            isinstance(delay, bool)
            or not isinstance(delay, int | float)
            or not math.isfinite(delay)
            or delay < 0
        ):
            raise bad(f"{at}.delay must be a non-negative number of seconds")
        usage = response.get("usage", {})
        if not isinstance(usage, dict):
            raise bad(f"{at}.usage must be an object")
        for key in _USAGE_KEYS:
            count = usage.get(key, 0)
            if count is not None and (
                isinstance(count, bool) or not isinstance(count, int) or count < 0
            ):
                raise bad(f"{at}.usage.{key} must be a whole number of tokens")
        stop = response.get("stop_reason")
        if stop is not None and not isinstance(stop, str):
            raise bad(f"{at}.stop_reason must be a string")
    summaries = data.get("summaries", [])
    if not isinstance(summaries, list) or not all(isinstance(t, str) for t in summaries):
        raise bad('"summaries" must be a list of strings')
    return responses


def load_script(path: Path) -> list[JSON]:
    return parse_script(_read_script(path), str(path))


def _read_script(path: Path) -> bytes:
    try:
        # never through a symlink: a task's script is a file of its own folder
        raw = read_regular(path)
    except FileNotFoundError:
        raise TaskSpecError(f"{path}: the task has no script; submit it with --script.") from None
    except OSError as exc:
        raise TaskSpecError(f"{path}: cannot read the script ({exc.strerror}).") from None
    return raw


def parse_script(raw: bytes, where: str) -> list[JSON]:
    """The responses of a script file's bytes; ``where`` (its path) names it in errors.

    A JSON error says where it is (line and column, as an editor counts them) and what
    the file should be, since the decoder's own words ("Expecting ',' delimiter") leave
    an operator to guess which file and which place.
    """
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise TaskSpecError(
            f"{where}: line {exc.lineno}, column {exc.colno}: not valid JSON ({exc.msg}); "
            'a script is a JSON object {"responses": [...]} (see '
            "docs/reference/scripted-model.md)."
        ) from None
    except UnicodeDecodeError as exc:
        raise TaskSpecError(
            f"{where}: byte {exc.start}: not UTF-8 text; save the script as UTF-8 JSON."
        ) from None
    return _validate(data, where)


def validate_script(data: Any, where: str) -> list[JSON]:
    """The responses of an already decoded script (``parse_script`` decodes first)."""
    return _validate(data, where)


def default_summary(summary: SummaryOf) -> str:
    """The summary a script without ``summaries`` gets: it names what it replaces."""
    return (
        f"Compaction {summary.index + 1}: a summary of turns {summary.first} to "
        f"{summary.last}, made by the scripted model."
    )


def past_the_end(where: str, responses: int, index: int) -> str:
    """Why model call ``index + 1`` of a script of ``responses`` responses has none, and how
    to go on (no full stop: the failed task's reason, and what ``agentd retry`` warns of)."""
    return (
        f"{where} has {responses} responses (responses[0] to responses[{responses - 1}]) and "
        f"model call {index + 1} asks for responses[{index}], past its end; add responses "
        "to the script (docs/reference/scripted-model.md), or end it with a response "
        "without a tool_use, which ends the task"
    )


class ScriptedModel:
    def __init__(
        self,
        responses: list[JSON],
        *,
        summaries: list[str] | None = None,
        sleep: Callable[[float], None] = time.sleep,
        where: str = "the script",
    ) -> None:
        self.responses = responses
        self.summaries = summaries or []
        self._sleep = sleep
        self.where = where  # (names it in the reason of a call past its end)

    @classmethod
    def from_file(cls, path: Path) -> ScriptedModel:
        return cls.from_bytes(_read_script(path), str(path))

    @classmethod
    def from_bytes(cls, raw: bytes, where: str) -> ScriptedModel:
        """The script ``raw`` (read from a store); ``where`` names it in errors."""
        responses = parse_script(raw, where)
        return cls(responses, summaries=list(json.loads(raw).get("summaries", [])), where=where)

    def complete(self, request: ModelRequest, *, turn_index: int) -> ModelReply:
        if request.summary is not None:
            return self._summarise(request, request.summary)
        if turn_index >= len(self.responses):
            raise ModelError(past_the_end(self.where, len(self.responses), turn_index) + ".")
        response = self.responses[turn_index]
        if delay := response.get("delay"):
            self._sleep(float(delay))
        content: list[JSON] = []
        for i, scripted in enumerate(response["content"]):
            block = dict(scripted)
            if block["type"] == "tool_use":
                block.setdefault("id", _default_id(turn_index, i))
            content.append(block)
        has_tool = any(b["type"] == "tool_use" for b in content)
        stop = response.get("stop_reason") or ("tool_use" if has_tool else "end_turn")
        written = response.get("usage")
        usage = Usage.from_json(
            written or {"input_tokens": request_tokens(request), "output_tokens": 5}
        )
        return ModelReply(content, stop, usage, request.model)

    def _summarise(self, request: ModelRequest, summary: SummaryOf) -> ModelReply:
        if summary.index < len(self.summaries):
            text = self.summaries[summary.index]
        else:
            text = default_summary(summary)
        usage = Usage(input_tokens=10 * len(request.messages), output_tokens=len(text) // 4 + 1)
        return ModelReply([{"type": "text", "text": text}], "end_turn", usage, request.model)

    def close(self) -> None:
        pass
