"""The ``anthropic`` model backend: the official SDK's Messages API, streamed.

The SDK is imported lazily (it costs about a second), on the first call, so a worker that
resumes into a hold or a finished task never pays for it. The key and auth token are given
explicitly (a worker holds them in memory, never in its environment: worker.credentials);
what is not given, the SDK reads from the environment (``ANTHROPIC_BASE_URL`` among them).

The SDK's own retries are off: every fault comes back at once as a ``worker.errors``
exception and ``worker.models.retry.call_with_retries`` decides. Retryable: 408, 409, 429,
5xx, 529, an ``error`` event inside the stream of those kinds, connection loss, timeouts,
a stream that breaks, is malformed or ends before ``message_stop``, and a tool_use whose
streamed input is not valid JSON as a whole (the SDK's lenient parser would read a garbled
tail as a shorter object, and the tool would run on input the model never sent). Final:
400, 401, 402, 403, 404, 413, missing credentials, each with a one-line reason saying what
to fix; a 400 saying the prompt is too long is a ``ContextTooLongError``, which the loop
answers with a compaction. No message ever contains the API key: known secrets are
scrubbed from every text that leaves this module, and SDK exceptions are not chained
(their text carries the raw response).

``[context] strategy = "server"`` (a request with ``compact_trigger``) goes through the
SDK's beta Messages API with the ``compact_20260112`` context-management edit (beta
``compact-2026-01-12``): the API compacts on its own once the prompt reaches the trigger.
The edit is the one of the SDK's two forms that takes a trigger, so the decision stays
with ``[context] window`` and ``compact_at`` and needs no call of its own (the newer
``compaction`` parameter, beta ``compact-2026-09-04``, makes every request that carries
it a compaction request: agentd would have to decide when, as its client strategy does).
``pause_after_compaction`` is on: the reply is the ``compaction`` block alone, with
``stop_reason`` ``compaction``, which the loop records as a turn (durable before the
model goes on from it) and continues with a new request. Its usage is counted once
(``_reply_usage``). Consecutive messages of one role are sent as one message, as the API
reads them anyway: the reply that continues a paused turn is recorded as a turn of its
own, and the API gets it as the rest of the turn, after the compaction block.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from worker import credentials
from worker.errors import ContextTooLongError, ModelError, RetryableModelError
from worker.models.base import JSON, ModelReply, ModelRequest, Usage
from worker.models.retry import ThrottledError
from worker.redactor import REDACTED

if TYPE_CHECKING:
    import ssl

    import anthropic
    import httpx2
    from anthropic.types import ContentBlock

RETRY_TASK = "run `agentd retry TASK`"
COMPACTION_BETA = "compact-2026-01-12"  # the beta of the compact_20260112 edit
_RETRYABLE_TYPES = frozenset({"rate_limit_error", "overloaded_error", "api_error", "timeout_error"})


def key_hint() -> str:
    """How to give the daemon a (new) API key, then the task another go: what works where
    this worker's key came from (``credentials.how_to_change``)."""
    how = credentials.how_to_change(credentials.API_KEY, os.environ)
    return f"{how}; then {RETRY_TASK}"


def tls_context() -> ssl.SSLContext:
    """The SDK's default TLS context (its HTTP stack's, which honours ``SSL_CERT_FILE`` and
    ``SSL_CERT_DIR``), built once per process: loading the CA bundle costs tens of
    milliseconds. The fork server builds it before it forks, so a worker starts with it."""
    return _tls_context(os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))


@functools.cache
def _tls_context(cafile: str | None, capath: str | None) -> ssl.SSLContext:
    import httpx2  # noqa: PLC0415  (lazy, with the SDK)

    return httpx2.create_ssl_context(verify=True, trust_env=True)


#: The HTTP client built ahead (``prepare_http_client``), with the environment it read.
_prepared: tuple[httpx2.Client, dict[str, str]] | None = None


def _http_environment() -> dict[str, str]:
    """What of the environment an HTTP client reads as it is built: proxies, CA files."""
    return {
        k: v for k, v in os.environ.items() if k.lower().endswith("_proxy") or k.startswith("SSL_")
    }


def prepare_http_client() -> None:
    """Build the HTTP client of this process's first model call now, ahead of its task (a
    standby worker does: ``worker.forkserver``). It holds no secret and opens no socket;
    the call takes it only if the environment it read is still the process's."""
    global _prepared  # noqa: PLW0603  (one client built ahead, taken once)
    import anthropic  # noqa: PLC0415  (lazy: the SDK takes a second to import)

    _prepared = (anthropic.DefaultHttpxClient(verify=tls_context()), _http_environment())


def http_client() -> httpx2.Client:
    """The HTTP client for a model client: the one built ahead, if it fits, else a new one."""
    global _prepared
    found, _prepared = _prepared, None
    if found is not None:
        if found[1] == _http_environment():
            return found[0]
        found[0].close()
    import anthropic  # noqa: PLC0415  (lazy: the SDK takes a second to import)

    return anthropic.DefaultHttpxClient(verify=tls_context())


class MessagesAPIModel:
    """``Model`` on the Anthropic Messages API.

    ``api_key``/``auth_token``/``base_url``: explicit values, else the SDK's environment
    defaults.
    ``timeout``: seconds the connection may stay silent (connect, read between stream
    events, write) before the call is abandoned as retryable; None keeps the SDK default
    (10 minutes). The whole call is bounded by the supervisor's progress deadline.
    """

    offers_server_compaction = True  # worker.models.base.ServerCompaction

    def __init__(
        self,
        *,
        api_key: str | None = None,
        auth_token: str | None = None,
        base_url: str | None = None,
        timeout: float | None = None,
    ) -> None:
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout must be positive, not {timeout}")
        self._api_key = api_key
        self._auth_token = auth_token
        self._base_url = base_url
        self._timeout = timeout
        self._client: anthropic.Anthropic | None = None

    # -- the Model protocol ---------------------------------------------------------------

    def complete(self, request: ModelRequest, *, turn_index: int) -> ModelReply:
        import anthropic  # noqa: PLC0415  (lazy: the SDK takes a second to import)
        import httpx2  # noqa: PLC0415  (lazy, with the SDK)

        params: dict[str, Any] = {
            "model": request.model,
            "max_tokens": request.max_tokens,
            "messages": one_role_a_message(request.messages),
        }
        if request.system:
            params["system"] = request.system
        if request.tools:
            params["tools"] = list(request.tools)
        if request.compact_trigger is not None:
            params["context_management"] = {"edits": [compaction_edit(request.compact_trigger)]}
        if request.compact_trigger is not None or _holds_compaction(params["messages"]):
            params["betas"] = [COMPACTION_BETA]  # a compaction block takes it too
        try:
            return self._stream(self._get_client(), params)
        except anthropic.APIStatusError as exc:
            raise self._status_error(exc, request) from None
        except anthropic.APITimeoutError:
            raise self._retryable(f"The Anthropic API call timed out{self._after()}") from None
        except anthropic.APIConnectionError as exc:
            raise self._retryable(
                f"The connection to the Anthropic API failed ({_cause(exc)})"
            ) from None
        except anthropic.APIError as exc:
            raise self._retryable(f"The Anthropic API sent an unusable response ({exc})") from None
        except anthropic.CredentialsError as exc:
            raise self._error(
                f"The Anthropic SDK could not load credentials ({exc}); {key_hint()}."
            ) from None
        except httpx2.TimeoutException:
            raise self._retryable(f"The Anthropic API stream stalled{self._after()}") from None
        except httpx2.HTTPError as exc:
            detail = f"{type(exc).__name__}: {exc}"
            raise self._retryable(f"The Anthropic API stream broke off ({detail})") from None

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.close()

    # -- internals ------------------------------------------------------------------------

    def _get_client(self) -> anthropic.Anthropic:
        if self._client is not None:
            return self._client
        import anthropic  # noqa: PLC0415  (lazy: the SDK takes a second to import)

        options: dict[str, Any] = {"max_retries": 0}
        if self._api_key is not None:
            options["api_key"] = self._api_key
        if self._auth_token is not None:
            options["auth_token"] = self._auth_token
        if self._base_url is not None:
            options["base_url"] = self._base_url
        if self._timeout is not None:
            options["timeout"] = self._timeout
        options["http_client"] = http_client()
        client = anthropic.Anthropic(**options)
        if client.api_key is None and client.auth_token is None and client.credentials is None:
            client.close()
            raise ModelError(f"No Anthropic API key is set; {key_hint()}.")
        self._client = client
        return client

    def _stream(self, client: anthropic.Anthropic, params: dict[str, Any]) -> ModelReply:
        import anthropic  # noqa: PLC0415  (imported already: ``complete`` did)

        # the beta API's stream and message types are the same shapes as the GA ones'
        manager: contextlib.AbstractContextManager[Any] = (
            client.beta.messages.stream(**params)
            if "betas" in params
            else client.messages.stream(**params)
        )
        with manager as stream:
            stopped = False
            tool_json: dict[int, str] = {}  # block index -> its input JSON, as streamed
            try:
                for event in stream:
                    stopped = stopped or event.type == "message_stop"
                    if (
                        event.type == "content_block_delta"
                        and event.delta.type == "input_json_delta"
                    ):
                        tool_json[event.index] = tool_json.get(event.index, "") + (
                            event.delta.partial_json
                        )
            except (ValueError, RuntimeError) as exc:  # bad JSON, events out of order
                raise self._retryable(
                    f"The Anthropic API sent a malformed stream ({exc})"
                ) from None
            # Once the stream has begun, silence is a stall and a broken connection a
            # stream that broke off, however the SDK wraps httpx's error (anthropic 2.17
            # wraps them as it does a request's: APITimeoutError, APIConnectionError)
            except anthropic.APITimeoutError:
                raise self._retryable(f"The Anthropic API stream stalled{self._after()}") from None
            except anthropic.APIConnectionError as exc:
                raise self._retryable(
                    f"The Anthropic API stream broke off ({_cause(exc)})"
                ) from None
            if not stopped:
                raise self._retryable("The Anthropic API stream ended before message_stop")
            message = stream.get_final_message()
        if message.stop_reason is None:
            raise self._retryable("The Anthropic API stream ended without a stop_reason")
        content = [_block_json(block) for block in message.content]
        for index, block in enumerate(content):
            if block["type"] == "tool_use" and not isinstance(block.get("input"), dict):
                raise self._retryable("The Anthropic API sent a tool_use input that is no object")
            # The SDK parses tool input JSON leniently (a truncated or garbled tail can read
            # as a shorter object): the whole streamed text must be valid JSON, and the same.
            if index in tool_json and _strict_json(tool_json[index]) != block.get("input"):
                raise self._retryable(
                    "The Anthropic API sent a tool_use input that is not valid JSON"
                )
        usage, context_tokens = _reply_usage(message.usage)
        return ModelReply(
            content=content,
            stop_reason=message.stop_reason,
            usage=usage,
            model=message.model,
            context_tokens=context_tokens,
            id=message.id or "",
        )

    def _status_error(self, exc: anthropic.APIStatusError, request: ModelRequest) -> ModelError:
        status, kind = exc.status_code, str(exc.type or "")
        where = f"{status} {kind}".strip() if status >= 400 else f"{kind or 'error'} mid-stream"
        detail = f"{where}: {exc.api_message}" if exc.api_message else where
        if status in (408, 409, 429) or status >= 500 or kind in _RETRYABLE_TYPES:
            if status == 529 or kind == "overloaded_error":
                said = "is overloaded"
            elif status == 429 or kind == "rate_limit_error":
                said = "rate-limited the request"
            else:
                said = "failed"
            message = self._scrub(f"The Anthropic API {said} ({detail}).")
            retry_after = _retry_after(exc)
            if retry_after is not None:
                return ThrottledError(message, retry_after)
            return RetryableModelError(message)
        if status == 401 or kind == "authentication_error":
            return self._error(f"The Anthropic API rejected the API key (401); {key_hint()}.")
        if status == 403 or kind == "permission_error":
            return self._error(
                f"The Anthropic API key may not make this request ({detail}); use a key with "
                f"access to model {request.model!r} and {RETRY_TASK}."
            )
        if status == 404 or kind == "not_found_error":
            return self._error(
                f"The Anthropic API does not know model {request.model!r} ({detail}); choose an "
                f"available model (check ANTHROPIC_BASE_URL too) and {RETRY_TASK}."
            )
        if status == 402 or kind == "billing_error":
            return self._error(
                f"The Anthropic API refused the request for billing ({detail}); check the "
                f"account's plan and credits and {RETRY_TASK}."
            )
        if status == 400 and "prompt is too long" in str(exc.api_message or "").lower():
            return ContextTooLongError(
                self._scrub(f"The Anthropic API refused the prompt ({detail})")
            )
        if status == 413:
            return self._error(
                f"The request is too large for the Anthropic API ({detail}); rewind or fork "
                "the task to an earlier turn."
            )
        return self._error(
            f"The Anthropic API rejected the request ({detail}); fix what it names (model, "
            f"max_tokens, tools or transcript) and {RETRY_TASK}."
        )

    def _after(self) -> str:
        return f" (silent for {self._timeout:g} s)" if self._timeout is not None else ""

    def _secrets(self) -> list[str]:
        found = [
            self._api_key,
            self._auth_token,
            *credentials.held().secrets(),
            *(os.environ.get(name) for name in credentials.CREDENTIAL_NAMES),
        ]
        if self._client is not None:
            found += [self._client.api_key, self._client.auth_token]
        return sorted({s for s in found if s and len(s) >= 4}, key=len, reverse=True)

    def _scrub(self, text: str) -> str:
        """One line, bounded, with every known secret replaced."""
        for secret in self._secrets():
            text = text.replace(secret, REDACTED)
        text = " ".join(text.split())
        return text if len(text) <= 400 else text[:397] + "..."

    def _error(self, message: str) -> ModelError:
        return ModelError(self._scrub(message))

    def _retryable(self, what: str) -> RetryableModelError:
        return RetryableModelError(self._scrub(f"{what}."))


def compaction_edit(trigger: int) -> JSON:
    """The context-management edit that has the API compact at ``trigger`` input tokens
    and pause there (the reply is then the compaction block, ``stop_reason``
    ``compaction``)."""
    return {
        "type": "compact_20260112",
        "trigger": {"type": "input_tokens", "value": trigger},
        "pause_after_compaction": True,
    }


def one_role_a_message(messages: Sequence[JSON]) -> list[JSON]:
    """``messages`` with each run of one role joined into one message, as the API reads
    them: a paused turn (``pause_turn``, ``compaction``) and the turn that continues it."""
    joined: list[JSON] = []
    for message in messages:
        if joined and joined[-1]["role"] == message["role"]:
            joined[-1] = {
                "role": message["role"],
                "content": [*_blocks(joined[-1]["content"]), *_blocks(message["content"])],
            }
        else:
            joined.append(message)
    return joined


def _holds_compaction(messages: Sequence[JSON]) -> bool:
    """Whether a request sends back a compaction block (one with a summary: the API takes a
    null one, a failed compaction, as a no-op)."""
    return any(
        b.get("type") == "compaction" and b.get("content") is not None
        for m in messages
        if isinstance(m["content"], list)
        for b in m["content"]
    )


def _blocks(content: str | list[JSON]) -> list[JSON]:
    return [{"type": "text", "text": content}] if isinstance(content, str) else content


def _usage_of(usage: Any) -> Usage:
    """The SDK's usage as ours; the 1-hour share of the cache writes, which is priced
    apart (``worker.budget``), is read from ``cache_creation`` where the API sends it."""
    split = getattr(usage, "cache_creation", None)
    return Usage(
        input_tokens=usage.input_tokens or 0,
        output_tokens=usage.output_tokens or 0,
        cache_creation_input_tokens=usage.cache_creation_input_tokens or 0,
        cache_read_input_tokens=usage.cache_read_input_tokens or 0,
        cache_creation_1h_input_tokens=getattr(split, "ephemeral_1h_input_tokens", 0) or 0,
    )


def _reply_usage(usage: Any) -> tuple[Usage, int | None]:
    """What a reply counts, once, and its ``tokens_used`` when its usage does not say it.

    The top-level usage is the sampling's alone: a server compaction is reported only as
    a ``compaction`` entry of ``usage.iterations`` ("not included in the top-level usage
    fields", the SDK says). So a reply counts the top level plus each compaction entry;
    adding every entry would count the sampling twice. Its context is not the
    compaction's input (the old context, now gone) but the last sampling entry's, or,
    when the reply ends on its compaction (paused), the summary alone: its output."""
    top = _usage_of(usage)
    iterations = getattr(usage, "iterations", None) or []
    compactions = [it for it in iterations if it.type == "compaction"]
    if not compactions:
        return top, None
    billed = sum((_usage_of(it) for it in compactions), top)
    last = iterations[-1]
    context = last.output_tokens if last.type == "compaction" else _usage_of(last).context_tokens
    return billed, context


def _block_json(block: ContentBlock) -> JSON:
    """A reply block as the API accepts it back: the fields the API sent, verbatim, minus
    SDK-only ones. Only fields set from the response are dumped (``exclude_unset``), so a
    block agentd does not interpret (thinking and its signature, redacted_thinking, server
    tool blocks, compaction blocks, a type newer than the SDK) keeps every field, a null
    one included, and gains none of the SDK's defaults."""
    exclude = getattr(block, "__api_exclude__", None)
    data: JSON = block.model_dump(mode="json", by_alias=True, exclude_unset=True, exclude=exclude)
    if block.type in ("tool_use", "server_tool_use"):
        data["input"] = block.input  # verbatim: a null inside the input is part of it
    return data


_INVALID = object()


def _strict_json(text: str) -> Any:
    """``text`` parsed as one JSON value, or a sentinel equal to nothing when it is not."""
    try:
        return json.loads(text) if text else {}
    except ValueError:
        return _INVALID


def _cause(exc: BaseException) -> str:
    cause = exc.__cause__ or exc.__context__
    return f"{type(cause).__name__}: {cause}" if cause is not None else str(exc)


def _retry_after(exc: anthropic.APIStatusError) -> float | None:
    headers = exc.response.headers
    try:
        if (ms := headers.get("retry-after-ms")) is not None:
            return max(0.0, float(ms) / 1000)
        if (seconds := headers.get("retry-after")) is not None:
            return max(0.0, float(seconds))
    except ValueError:  # an HTTP date: leave the pause to the backoff
        return None
    return None
