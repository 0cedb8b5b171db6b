"""Process-level chaos campaigns: real workers, real signals, an external record of effects.

``CAMPAIGN`` is the one list of the fault classes (the numbers of
docs/results/reliability.md) and the module of each; every module has
``run(quick) -> list[Figure]``. ``python -m tests.chaos`` runs them into one table, and
``tests/test_campaigns.py`` runs each quick mode as a test.
"""

#: (fault classes, module): in the order of the classes.
CAMPAIGN = (
    ("1", "tests.chaos.kill9"),
    ("2", "tests.faults.crash_points"),
    ("3", "tests.faults.io_errors"),
    ("4", "tests.faults.torn"),
    ("5", "tests.chaos.compound"),
    ("6 7 9", "tests.chaos.supervision"),
    ("8", "tests.chaos.api_faults"),
    ("10", "tests.faults.fuzz"),
    ("11", "tests.faults.security"),
    ("12", "tests.chaos.escape"),
    ("13", "tests.chaos.secrets"),
    ("14", "tests.chaos.tampering"),
    ("15", "tests.chaos.powerloss"),
    ("16", "tests.chaos.storage"),
    ("17", "tests.chaos.signals"),
    ("18", "tests.chaos.operator"),
    ("19", "tests.chaos.clock"),
    ("20", "tests.chaos.compaction"),
    ("21", "tests.chaos.nodes"),
    ("22", "tests.chaos.trust"),
    ("23", "tests.chaos.mcp"),
    ("24", "tests.chaos.run"),
    ("25", "tests.chaos.approvals"),
    ("26", "tests.chaos.conversations"),
)
