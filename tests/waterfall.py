"""The waterfall of one task's trace, drawn from what a real OTLP receiver got: the picture
in docs/guides/traces.md (``docs/trace-waterfall.svg``).

``python -m tests.waterfall [OUT.svg]`` runs a real daemon on a temporary spool, its
workers on the real SDK against the local Messages API, exporting to the receiver of
``tests/otlp.py``; kills the worker with SIGKILL in its second turn's tool call; and draws
every span the receiver decoded for the task: one row a span, in time order, each child
under its run, bars to scale, errors in red, the run spans' events as ticks. ``render``
is the drawing alone (plain SVG, no dependency).
"""

from __future__ import annotations

import html
import os
import signal
import sys
import tempfile
from pathlib import Path

from tests.daemon import Daemon, subreaper
from tests.otlp import OTLPReceiver, Received
from tests.support import poll_for
from worker.spans import identity, trace_id
from worker.testing.messages_api import DEFAULT_API_KEY, MessagesAPIServer, Reply, by_turn

OUT = Path(__file__).resolve().parents[1] / "docs" / "trace-waterfall.svg"
ROW = 22
LABEL = 330
WIDTH = 1000
COLOURS = {"invoke_agent": "#4c78a8", "chat": "#9467bd", "execute_tool": "#54a24b"}


def _order(spans: list[Received]) -> list[tuple[Received, int]]:
    """Each run, then its children in time order: (span, depth)."""
    runs = sorted((s for s in spans if not s.parent), key=lambda s: s.start)
    rows: list[tuple[Received, int]] = []
    for run in runs:
        rows.append((run, 0))
        children = sorted((s for s in spans if s.parent == run.span_id), key=lambda s: s.start)
        rows += [(child, 1) for child in children]
    return rows


def render(spans: list[Received], title: str) -> str:
    """An SVG waterfall of ``spans`` (one trace)."""
    rows = _order(spans)
    start = min(s.start for s in spans)
    end = max(s.end for s in spans)
    scale = (WIDTH - LABEL - 110) / max(end - start, 1)
    events = sum(len(s.events) for s, depth in rows if depth == 0)
    height = 60 + ROW * len(rows) + 14 * events + 30

    def x(t: int) -> float:
        return LABEL + (t - start) * scale

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'font-family="sans-serif" font-size="12">',
        f'<rect width="{WIDTH}" height="{height}" fill="white"/>',
        f'<text x="10" y="22" font-size="14" font-weight="bold">{html.escape(title)}</text>',
        f'<text x="10" y="42" fill="#555">trace {spans[0].trace_id}; '
        f"{(end - start) / 1e9:.2f} s, {len(spans)} spans</text>",
    ]
    top = 55 - ROW
    for span, depth in rows:
        top += ROW
        kind = span.name.split(" ")[0]
        colour = COLOURS.get(kind, "#888")
        error = span.status == 2
        seconds = (span.end - span.start) / 1e9
        label = html.escape(f"{span.name}")
        out.append(
            f'<text x="{10 + 16 * depth}" y="{top + 14}">{label}</text>'
            f'<rect x="{x(span.start):.1f}" y="{top + 3}" '
            f'width="{max((span.end - span.start) * scale, 2):.1f}" height="{ROW - 8}" '
            f'fill="{colour}" stroke="{"#d62728" if error else colour}" '
            f'stroke-width="{3 if error else 1}" rx="2"/>'
            f'<text x="{x(span.end) + 4:.1f}" y="{top + 14}" fill="#333">{seconds * 1000:.0f} ms'
            f"{' ERROR' if error else ''}</text>"
        )
        for name, at, _ in sorted(span.events, key=lambda e: e[1]) if depth == 0 else []:
            top += 14  # each event its own line under its run: labels never overlap
            out.append(
                f'<line x1="{x(at):.1f}" x2="{x(at):.1f}" y1="{top - 14 * 0}" y2="{top + 6}" '
                f'stroke="#f58518" stroke-width="2"><title>{html.escape(name)}</title></line>'
                f'<text x="{x(at) + 4:.1f}" y="{top + 16}" fill="#f58518" font-size="10">'
                f"{html.escape(name)}</text>"
            )
    out.append(
        f'<text x="10" y="{height - 10}" fill="#555">blue: invoke_agent (a worker run), '
        "purple: chat (a model call), green: execute_tool; red outline: status ERROR; "
        "orange: span events</text></svg>"
    )
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    out = Path((argv or sys.argv[1:] or [str(OUT)])[0])
    replies = [
        Reply.tool_use("write_file", {"path": "plan.txt", "content": "1. look 2. write"}),
        Reply.tool_use("stall", {"seconds": 60, "once": "stalled"}, text="Waiting."),
        Reply.tool_use("read_file", {"path": "plan.txt"}),
        Reply.text("Done."),
    ]
    with (
        tempfile.TemporaryDirectory(prefix="agentd-waterfall-") as tmp,
        subreaper(),
        OTLPReceiver() as receiver,
        MessagesAPIServer(responder=by_turn(list(replies))) as api,
    ):
        config = (
            "[heartbeat]\ninterval = 0.2\ntimeout = 10.0\n"
            "[restart]\nbackoff_initial = 0.05\nbackoff_max = 0.2\n"
            '[tools]\nmodules = ["tests.crash_tools"]\n'
            '[model]\nname = "claude-sonnet-5-5"\nmax_tokens = 256\n'
            f'[telemetry]\notlp_endpoint = "{receiver.endpoint}"\n'
        )
        daemon = Daemon(Path(tmp), config)
        try:
            daemon.start({"ANTHROPIC_BASE_URL": api.base_url, "ANTHROPIC_API_KEY": DEFAULT_API_KEY})
            code, task, err = daemon.cli("submit", "--name", "waterfall", "--prompt", "Plan it.")
            assert code == 0, err
            task = task.strip()
            row = daemon.wait_row(task, lambda r: r["phase"] == "tool:stall", what="the stall")
            os.kill(row["pid"], signal.SIGKILL)
            daemon.wait_state(task, "done", timeout=60)
            trace = trace_id(identity(task, daemon.task(task).load_spec().created_at))

            def complete() -> list[Received] | None:
                spans = [s for s in receiver.received() if s.trace_id == trace]
                return spans if len(spans) >= 9 else None

            spans = poll_for(complete, 60, what="the task's spans")
            daemon.stop()
        finally:
            daemon.cleanup()
    out.write_text(render(spans, "one task across a kill -9 of its worker, as received"))
    print(f"wrote {out} ({len(spans)} spans)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
