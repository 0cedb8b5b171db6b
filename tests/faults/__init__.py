"""The fault-injection and security campaign: attacks on every failure mode, with figures.

One module per fault class, each with ``run(quick: bool) -> list[Figure]``:

* ``crash_points``: SIGKILL at the i-th durable syscall of a task, for every i (strace);
* ``io_errors``: ENOSPC and EIO on the worker's writes and syncs, once and for good (strace);
* ``torn``: journals cut at every byte offset of their tail, bit flips in the tail and in
  the middle, given to the real worker;
* ``fuzz``: hypothesis against every parser (journal, snapshot, spec, script, config,
  decision files, CLI arguments) and a daemon on a spool full of garbage;
* ``security``: spool modes under every umask, symlinks planted in the spool and the
  workspace, hostile ids and tool paths, a canary API key.

``python -m tests.faults [--full] [--only NAME]`` prints one table of every figure and
exits 1 when any figure is a violation; ``tests/test_campaigns.py`` runs the quick mode of
each module in ``make test``.
"""
