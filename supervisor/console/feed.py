"""The console's change feed: one server-sent event per change of a task's row
(``GET /api/stream``, docs/design.md section 12), however many pages watch.

One ``RowFeed`` per console looks, every ``FEED_INTERVAL`` seconds and only while some
stream is open, at a fingerprint of every task: its record's version and the fields of
its worker's heartbeat that a row shows (turn, phase, usage, tokens, compactions), and on
a shared store the node that holds its lease. Only a task whose fingerprint moved has its
row built again (``overview.task_row``: for a task at rest, a replay from its snapshot),
and only a row that differs from the last one sent, its ``heartbeat_age`` aside, is sent:
a page never polls, and an idle console reads a stat per task per interval (on a shared
store, the one statement ``status`` makes). A new stream is first sent every row as the
feed knows it, then the changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
from collections.abc import Callable, Mapping
from typing import Any

from supervisor.overview import supervisor_json, task_row
from supervisor.stores import store_for
from worker.budget import BUILTIN_PRICES, Price
from worker.errors import AgentdError
from worker.spool import Spool

#: Seconds between two looks at the tasks while a stream is open.
FEED_INTERVAL = 1.0
#: Rows a stream may have waiting to be written: one slower than that is closed.
STREAM_BACKLOG = 5000
#: The heartbeat fields a row shows (``status.status_row``).
_BEAT_FIELDS = ("pid", "turn", "phase", "usage", "tokens_used", "compactions", "sandbox", "retry")

Row = dict[str, Any]
Scan = Callable[[], list[Row]]  # a look at the tasks, run off the loop


class RowFeed:
    """The rows as last sent, and the queues of the open streams."""

    def __init__(
        self,
        spool: Spool,
        run: Callable[[Scan], Any],
        prices: Callable[[], Mapping[str, Price]] = lambda: BUILTIN_PRICES,
    ) -> None:
        self.spool = spool
        self._run = run  # runs a scan off the loop: ``await run(scan)``
        self._prices = prices  # what a row's cost_usd is reckoned at (the config's, now)
        self._prints: dict[str, Any] = {}
        self.rows: dict[str, Row] = {}
        self._streams: set[asyncio.Queue[Row | None]] = set()
        self._task: asyncio.Task[None] | None = None
        self._scanned = asyncio.Event()

    async def subscribe(self) -> asyncio.Queue[Row | None]:
        """A queue that gets every row now (once the feed has looked), then each change;
        a stream that falls ``STREAM_BACKLOG`` rows behind is dropped (``dropped``)."""
        queue: asyncio.Queue[Row | None] = asyncio.Queue()
        self._streams.add(queue)
        if self._task is None or self._task.done():
            self._scanned.clear()
            self._task = asyncio.create_task(self._watch())
        await self._scanned.wait()
        for row in list(self.rows.values()):
            queue.put_nowait(row)
        return queue

    def unsubscribe(self, queue: asyncio.Queue[Row | None]) -> None:
        self._streams.discard(queue)

    def dropped(self, queue: asyncio.Queue[Row | None]) -> bool:
        """Whether the stream of ``queue`` was dropped for falling behind."""
        return queue not in self._streams

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task

    async def _watch(self) -> None:
        while self._streams:
            # the scan works on copies, off the loop; what it found is kept here, on it
            prints, rows = dict(self._prints), dict(self.rows)
            try:
                changed = await self._run(functools.partial(self._scan, prints, rows))
            except AgentdError:  # the store is away: the next look
                changed = []
            else:
                self._prints, self.rows = prints, rows
            first = not self._scanned.is_set()
            self._scanned.set()
            if not first:
                for row in changed:
                    self._send(row)
            await asyncio.sleep(FEED_INTERVAL)
        self._prints.clear()
        self.rows.clear()

    def _send(self, row: Row) -> None:
        for queue in list(self._streams):
            if queue.qsize() >= STREAM_BACKLOG:
                self._streams.discard(queue)
                queue.put_nowait(None)  # (wakes its writer, which finds it dropped)
            else:
                queue.put_nowait(row)

    def _scan(self, prints: dict[str, Any], rows: dict[str, Row]) -> list[Row]:
        """(Off the loop.) The rows that changed since the scan that left ``prints`` and
        ``rows`` (copies, brought up to date here)."""
        store = store_for(self.spool)
        cluster = self.spool.shared
        leases = cluster.leases() if cluster is not None else None
        node = supervisor_json(self.spool)["node"]
        changed: list[Row] = []
        with store.read_all():
            ids = store.task_ids()
            for task_id in ids:
                with contextlib.suppress(AgentdError, OSError, ValueError):
                    version = store.get_record(task_id)[1].token
                    node_now = leases.get(task_id) if leases is not None else None
                    mark = (_fingerprint(version, store.read_heartbeat(task_id)), node_now)
                    if prints.get(task_id) == mark:
                        continue
                    row = task_row(self.spool.task(task_id), leases, node, self._prices())
                    prints[task_id] = mark
                    if _settled(row) != _settled(rows.get(task_id)):
                        rows[task_id] = row
                        changed.append(row)
        for gone in set(rows) - set(ids):
            del rows[gone]
            prints.pop(gone, None)
        return changed


def _fingerprint(version: str, beat: Any) -> str:
    seen = {k: beat.get(k) for k in _BEAT_FIELDS} if isinstance(beat, dict) else None
    return version + json.dumps(seen, sort_keys=True, default=str)


def _settled(row: Row | None) -> Row | None:
    """A row without what changes by itself (the heartbeat's age)."""
    return None if row is None else {k: v for k, v in row.items() if k != "heartbeat_age"}
