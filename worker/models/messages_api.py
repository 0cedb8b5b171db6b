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
"""

from __future__ import annotations

import functools
import json
import os
from typing import TYPE_CHECKING, Any

from worker import credentials
from worker.errors import ContextTooLongError, ModelError, RetryableModelError
from worker.models.base import JSON, ModelReply, ModelRequest, Usage
from worker.models.retry import ThrottledError
from worker.redactor import REDACTED

if TYPE_CHECKING:
    import ssl

    import anthropic
    from anthropic.types import ContentBlock

RETRY_TASK = "run `agentd retry TASK`"
_RETRYABLE_TYPES = frozenset({"rate_limit_error", "overloaded_error", "api_error", "timeout_error"})
NO_KEY = (
    "set ANTHROPIC_API_KEY for the daemon (in its environment, in the file "
    "ANTHROPIC_API_KEY_FILE names, or as the systemd credential anthropic_api_key)"
)


def tls_context() -> ssl.SSLContext:
    """The SDK's default TLS context (its HTTP stack's, which honours ``SSL_CERT_FILE`` and
    ``SSL_CERT_DIR``), built once per process: loading the CA bundle costs tens of
    milliseconds. The fork server builds it before it forks, so a worker starts with it."""
    return _tls_context(os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))


@functools.cache
def _tls_context(cafile: str | None, capath: str | None) -> ssl.SSLContext:
    import httpx2  # noqa: PLC0415  (lazy, with the SDK)

    return httpx2.create_ssl_context(verify=True, trust_env=True)


class MessagesAPIModel:
    """``Model`` on the Anthropic Messages API.

    ``api_key``/``auth_token``/``base_url``: explicit values, else the SDK's environment
    defaults.
    ``timeout``: seconds the connection may stay silent (connect, read between stream
    events, write) before the call is abandoned as retryable; None keeps the SDK default
    (10 minutes). The whole call is bounded by the supervisor's progress deadline.
    """

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
            "messages": list(request.messages),
        }
        if request.system:
            params["system"] = request.system
        if request.tools:
            params["tools"] = list(request.tools)
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
                f"The Anthropic SDK could not load credentials ({exc}); {NO_KEY} and {RETRY_TASK}."
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
        options["http_client"] = anthropic.DefaultHttpxClient(verify=tls_context())
        client = anthropic.Anthropic(**options)
        if client.api_key is None and client.auth_token is None and client.credentials is None:
            client.close()
            raise ModelError(f"No Anthropic API key is set; {NO_KEY}, and {RETRY_TASK}.")
        self._client = client
        return client

    def _stream(self, client: anthropic.Anthropic, params: dict[str, Any]) -> ModelReply:
        with client.messages.stream(**params) as stream:
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
        usage = message.usage
        return ModelReply(
            content=content,
            stop_reason=message.stop_reason,
            usage=Usage(
                input_tokens=usage.input_tokens,
                output_tokens=usage.output_tokens,
                cache_creation_input_tokens=usage.cache_creation_input_tokens or 0,
                cache_read_input_tokens=usage.cache_read_input_tokens or 0,
            ),
            model=message.model,
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
            return self._error(
                "The Anthropic API rejected the API key (401); set ANTHROPIC_API_KEY to a valid "
                f"key and {RETRY_TASK}."
            )
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


def _block_json(block: ContentBlock) -> JSON:
    """A reply block as the API accepts it back: its JSON, minus SDK-only and null fields."""
    exclude = getattr(block, "__api_exclude__", None)
    data: JSON = block.model_dump(mode="json", by_alias=True, exclude_none=True, exclude=exclude)
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
