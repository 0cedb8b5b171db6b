"""An MCP tool result as the model gets it: a tool_result's content and ``is_error``.

Text blocks and images become the tool_result's content (docs/design.md section 11);
``structuredContent`` becomes JSON text when the result gives no text; ``isError`` becomes
``is_error``. What the Messages API cannot carry is said in a line of text instead (audio,
a binary resource, a link to a resource), never dropped silently. The text is capped as a
command's output is (``worker.tools.builtin.bounded_text``) and images at
``IMAGE_LIMIT`` bytes each and ``MAX_IMAGES`` a result; the loop redacts secrets from every
text block before the result is recorded (``worker.recorder.without_secrets``).

Works on the result's JSON (``model_dump(by_alias=True)``), so it is pure and needs the SDK
only for that dump.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from typing import Any

from worker.tools.builtin import bounded_text
from worker.tools.tool import ToolResult

#: The image types the Messages API takes in a tool_result.
IMAGE_TYPES = frozenset({"image/jpeg", "image/png", "image/gif", "image/webp"})
#: The largest image kept, decoded (the API's own limit is 5 MB).
IMAGE_LIMIT = 5 * 1024 * 1024
#: Images kept in one result; more are named in text.
MAX_IMAGES = 20


def tool_result(result: Mapping[str, Any]) -> ToolResult:
    """``result`` (a ``CallToolResult`` as JSON) as a tool_result's content: plain text
    when it holds no image, else text and image blocks."""
    texts: list[str] = []
    images: list[dict[str, Any]] = []
    for item in result.get("content") or []:
        if not isinstance(item, Mapping):
            texts.append(f"[a content item agentd cannot show: {str(item)[:100]}]")
        elif item.get("type") == "image" and len(images) < MAX_IMAGES and (image := _image(item)):
            images.append(image)
        else:
            texts.append(_text_of(item))
    structured = result.get("structuredContent")
    if not texts and structured is not None:
        texts.append(json.dumps(structured, ensure_ascii=False, sort_keys=True))
    is_error = result.get("isError") is True
    text = bounded_text("\n".join(texts)) if texts else ""
    if not images:
        return ToolResult(text or "(no content)", is_error)
    return ToolResult([{"type": "text", "text": text}] * bool(text) + images, is_error)


def _image(item: Mapping[str, Any]) -> dict[str, Any] | None:
    """An image block for the API, or None when it is not one the API takes (a type it
    does not show, data that is not base64, too large): then it is described in text."""
    media_type = item.get("mimeType")
    data = item.get("data")
    if media_type not in IMAGE_TYPES or not isinstance(data, str):
        return None
    try:
        size = len(base64.b64decode(data, validate=True))
    except (binascii.Error, ValueError):
        return None
    if size > IMAGE_LIMIT:
        return None
    return {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}}


def _text_of(item: Mapping[str, Any]) -> str:
    kind = item.get("type")
    if kind == "text":
        return str(item.get("text", ""))
    if kind == "image":
        size = _size(item.get("data"))
        return f"[an image ({item.get('mimeType')}) the model cannot be shown: {size}]"
    if kind == "audio":
        return f"[audio ({item.get('mimeType')}), {_size(item.get('data'))}, not shown]"
    if kind == "resource":
        resource = item.get("resource")
        if isinstance(resource, Mapping):
            if isinstance(resource.get("text"), str):
                return f"[resource {resource.get('uri')}]\n{resource['text']}"
            size = _size(resource.get("blob"))
            return (
                f"[resource {resource.get('uri')} ({resource.get('mimeType')}), {size}, not shown]"
            )
    if kind == "resource_link":
        return f"[resource link {item.get('uri')}: {item.get('name', '')}]"
    return f"[a {kind} content item agentd cannot show]"


def _size(data: Any) -> str:
    return f"{len(data) * 3 // 4} bytes" if isinstance(data, str) else "no data"
