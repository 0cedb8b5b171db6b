"""Figures of the fault campaign and the one table they are printed in."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Figure:
    """One published number: ``violation`` marks a broken invariant (must be False)."""

    fault: str
    name: str
    value: int | float | str
    violation: bool = False


def _shown(value: int | float | str) -> str:
    if isinstance(value, float):
        return f"{value:.1f}"
    text = str(value).replace("\n", " | ")
    return text if len(text) <= 160 else text[:157] + "..."


def format_figures(figures: Iterable[Figure]) -> str:
    """The figures as one table: numbers right-aligned, violations marked ``VIOLATION``."""
    figures = list(figures)
    rows = [(f.fault, f.name, _shown(f.value), "VIOLATION" if f.violation else "") for f in figures]
    numeric = [r[2] for r, f in zip(rows, figures, strict=True) if not isinstance(f.value, str)]
    w_fault = max([len("FAULT"), *(len(r[0]) for r in rows)])
    w_name = max([len("FIGURE"), *(len(r[1]) for r in rows)])
    w_flag = len("VIOLATION")
    w_num = max([len("VALUE"), *(len(v) for v in numeric)])
    lines = [f"{'FAULT':<{w_fault}}  {'FIGURE':<{w_name}}  {'':<{w_flag}}  {'VALUE':>{w_num}}"]
    lines.append("  ".join("-" * w for w in (w_fault, w_name, w_flag, w_num)))
    for (fault, name, value, flag), figure in zip(rows, figures, strict=True):
        shown = value if isinstance(figure.value, str) else f"{value:>{w_num}}"
        lines.append(f"{fault:<{w_fault}}  {name:<{w_name}}  {flag:<{w_flag}}  {shown}".rstrip())
    bad = [f for f in figures if f.violation]
    lines.append(
        f"{len(figures)} figures, {len(bad)} violation(s)"
        + ("" if not bad else ": " + ", ".join(f"{f.fault}/{f.name}" for f in bad))
    )
    return "\n".join(lines)


def print_figures(figures: Iterable[Figure]) -> None:
    print(format_figures(figures), flush=True)


def violations(figures: Iterable[Figure]) -> list[Figure]:
    return [f for f in figures if f.violation]


def campaign_main(
    run: Callable[..., list[Figure]],
    prog: str,
    doc: str,
    argv: list[str] | None = None,
    *,
    seeded: bool = True,
) -> int:
    """The command line of a campaign module whose ``run(quick, *, seed)`` (``seeded``) or
    ``run(quick)`` gives its figures: ``[--full] [--seed N]``, the table printed, exit 1 on
    any violation."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n", maxsplit=1)[0])
    parser.add_argument("--full", action="store_true", help="the full campaign (make chaos)")
    if seeded:
        parser.add_argument("--seed", type=int, default=None, help="replay a run's choices")
    args = parser.parse_args(argv)
    figures = run(quick=not args.full, **({"seed": args.seed} if seeded else {}))
    print_figures(figures)
    return 1 if violations(figures) else 0
