"""What every benchmark in ``bench/`` returns and how ``python -m bench`` prints it.

A benchmark module has ``run(quick: bool) -> list[Row]``. One ``Row`` is one figure
measured side by side: agentd, the floor (what the hardware or the minimum work costs)
and a peer (another project doing the same job). The printer adds the ratios and says
whether the target was met; a benchmark only decides ``met`` because only it knows how
its target reads.
"""

from __future__ import annotations

import importlib
import math
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

MISSING = "-"


@dataclass(frozen=True)
class Row:
    bench: str  # the module that measured it: "checkpoint"
    figure: str  # what was measured: "per-turn record cost @ turn 1,000 (median)"
    unit: str  # "ms", "MB", "x"...
    agentd: float | None
    floor: float | None = None
    peer: float | None = None
    peer_name: str = ""  # the peer project, e.g. "LangGraph"
    target: str = ""  # "<= 1.5x floor", "< 20 ms"
    met: bool | None = None  # None: no target, or not measurable this run
    compare: bool = True  # print agentd/floor and agentd/peer ratios
    note: str = ""  # printed under the table

    @property
    def vs_floor(self) -> float | None:
        return _ratio(self.agentd, self.floor) if self.compare else None

    @property
    def vs_peer(self) -> float | None:
        return _ratio(self.agentd, self.peer) if self.compare else None


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def fmt_number(value: float | None) -> str:
    """Three significant digits, no exponent for the sizes benchmarks produce."""
    if value is None or math.isnan(value):
        return MISSING
    magnitude = abs(value)
    if magnitude >= 100:
        return f"{value:,.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    if magnitude >= 1:
        return f"{value:.2f}"
    if magnitude >= 0.01:
        return f"{value:.3f}"
    return f"{value:.2g}"


def fmt_value(value: float | None, unit: str) -> str:
    text = fmt_number(value)
    if text == MISSING or not unit:
        return text
    return f"{text}x" if unit == "x" else f"{text} {unit}"


def fmt_ratio(value: float | None) -> str:
    text = fmt_number(value)
    return text if text == MISSING else f"{text}x"


def render(rows: Sequence[Row]) -> str:
    """The rows as one plain-text table, grouped by benchmark, notes numbered below it."""
    peers = {r.peer_name for r in rows if r.peer_name}
    peer_head = peers.pop() if len(peers) == 1 else "peer"
    head = ["figure", "agentd", "floor", peer_head, "vs floor", f"vs {peer_head}", "target", "met"]
    body: list[list[str] | str] = []
    notes: list[str] = []
    bench = None
    for row in rows:
        if row.bench != bench:
            bench = row.bench
            body.append(f"[{bench}]")
        figure = row.figure
        if row.note:
            notes.append(row.note)
            figure += f" [{len(notes)}]"
        peer = fmt_value(row.peer, row.unit)
        if row.peer_name and len(peers) > 1 and peer != MISSING:
            peer += f" ({row.peer_name})"
        met = {True: "met", False: "MISSED", None: MISSING}[row.met]
        body.append(
            [
                figure,
                fmt_value(row.agentd, row.unit),
                fmt_value(row.floor, row.unit),
                peer,
                fmt_ratio(row.vs_floor),
                fmt_ratio(row.vs_peer),
                row.target or MISSING,
                met,
            ]
        )
    cells = [head, *(line for line in body if isinstance(line, list))]
    widths = [max(len(line[i]) for line in cells) for i in range(len(head))]

    def line_of(values: list[str]) -> str:
        first = values[0].ljust(widths[0])
        rest = [v.rjust(w) for v, w in zip(values[1:], widths[1:], strict=True)]
        return "  ".join([first, *rest]).rstrip()

    out = [line_of(head), line_of(["-" * w for w in widths])]
    for line in body:
        out.append(line if isinstance(line, str) else line_of(line))
    out.extend(f"[{i}] {note}" for i, note in enumerate(notes, 1))
    return "\n".join(out)


def print_table(rows: Sequence[Row]) -> None:
    print(render(rows), flush=True)


# -- peers ----------------------------------------------------------------------------


def ensure_peers(modules: Iterable[str], requirements: Path, *, install: bool) -> bool:
    """True when every module imports; with ``install``, first pip-install ``requirements``
    into this interpreter if one is missing. Never raises: a peer that cannot be had is
    reported by the caller and the benchmark goes on without it."""
    modules = list(modules)
    if _importable(modules):
        return True
    if not install:
        return False
    print(f"bench: installing peers from {requirements.name} ...", flush=True)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "-r", str(requirements)],
            check=False,
            capture_output=True,
            text=True,
            timeout=900,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        print(f"bench: pip failed: {exc}", flush=True)
        return False
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        print("bench: pip failed: " + " | ".join(tail), flush=True)
    importlib.invalidate_caches()
    return _importable(modules)


def _importable(modules: list[str]) -> bool:
    try:
        for name in modules:
            importlib.import_module(name)
    except ImportError:
        return False
    return True


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, ``q`` in [0, 1]."""
    if not values:
        return math.nan
    s = sorted(values)
    k = (len(s) - 1) * q
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)
