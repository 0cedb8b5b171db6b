"""A tool's effect class (docs/design.md section 5): what a call of it may do if it runs
twice, and so what happens to a call whose outcome is unknown. A module of its own, so
the config (``[tools.policy]``, an MCP server's ``effects``) names the classes without
importing the tools themselves."""

from __future__ import annotations

from enum import StrEnum


class Effect(StrEnum):
    READ_ONLY = "read_only"  # no side effect: re-run
    IDEMPOTENT = "idempotent"  # twice leaves what once does: re-run
    KEYED = "keyed"  # the service deduplicates by the call's key: re-run with the same key
    UNSAFE = "unsafe"  # may repeat a side effect: held for an operator

    @property
    def rerun_safe(self) -> bool:
        return self is not Effect.UNSAFE
