"""The store seam holds: nothing outside ``worker/store/`` opens, reads or writes a task
file (docs/ARCHITECTURE.md, "The store seam").

An AST scan of ``worker/`` and ``supervisor/`` finds the two ways code reaches a task file
without the store: a ``TaskDir`` file attribute (``task.journal``, ``task.state``, ...) and
a path joined with a task file's name (``task.path / "state.json"``), and an import of the
journal's framing (``worker.store.journal``). A ``TaskDir`` is told by
the name it goes by (``task``, ``parent``, ``slot.task``, ``spool.task(id)``), which is how
the code names them; naming a file in a message (inside an f-string) touches no file and is
not counted. What may still do it is in ``ALLOWED``, each entry with its reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support import REPO

#: ``TaskDir`` attributes that are the store's files (``worker/store/files.py``).
TASK_FILES = frozenset(
    {
        "journal",
        "snapshot",
        "state",
        "heartbeat",
        "exit",
        "events",
        "decisions",
        "decision_file",
        "cancellation",
        "spec",
        "script",
        "lock",
    }
)
#: The names of those files in a task folder (``task.path / "state.json"`` reaches one).
FILE_NAMES = frozenset(
    {
        "journal",
        "snapshot",
        "state.json",
        "heartbeat.json",
        "exit.json",
        "events.jsonl",
        "decisions",
        "cancelled.json",
        "spec.json",
        "script.json",
        "lock",
    }
)
#: Modules whose import is a task file's format: the store's alone.
STORE_INTERNALS = frozenset({"worker.store.journal"})
#: ``TaskDir`` methods that read a task file (the spec), and ``Spool`` ones that list the
#: task folders: the store's ``load_spec``, ``exists`` and ``task_ids``.
TASK_READS = frozenset({"load_spec", "exists"})
SPOOL_LISTS = frozenset({"tasks", "task_ids"})
SPOOL_NAMES = frozenset({"spool"})
#: The names a ``TaskDir`` goes by in worker/ and supervisor/.
TASK_NAMES = frozenset({"task", "parent", "child", "task_dir"})
SCANNED = ("worker", "supervisor")
INSIDE = "worker/store/"

#: (module, attribute or import) -> why it may reach the file itself.
ALLOWED: dict[tuple[str, str], str] = {
    ("worker/__main__.py", "script"): (
        "the scripted model reads its script file itself (its errors name the file); "
        "a test fixture of model replies, not a record of the task"
    ),
}


def _named(node: ast.expr, names: frozenset[str]) -> bool:
    """Whether ``node`` is a name or an attribute (``x.name``) in ``names``."""
    if isinstance(node, ast.Name):
        return node.id in names
    return isinstance(node, ast.Attribute) and node.attr in names


def _is_task_dir(node: ast.expr) -> bool:
    """Whether ``node`` names a ``TaskDir``: ``task``, ``x.task``, ``spool.task(id)``."""
    if _named(node, TASK_NAMES):
        return True
    if isinstance(node, ast.Call):
        func = node.func
        return (isinstance(func, ast.Attribute) and func.attr == "task") or (
            isinstance(func, ast.Name) and func.id == "TaskDir"
        )
    return False


def _in_messages(tree: ast.AST) -> set[int]:
    """The ids of the nodes inside f-string fields: a file named in a message."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FormattedValue):
            inside.update(id(n) for n in ast.walk(node.value))
    return inside


def reaches(source: str, module: str) -> list[tuple[int, str]]:
    """Each place in ``source`` (the file ``module``) that reaches a task file itself, as
    (line, what): the attribute, file name or module."""
    tree = ast.parse(source, module)
    messages = _in_messages(tree)
    found = []
    for node in ast.walk(tree):
        what = None
        if isinstance(node, ast.Attribute) and id(node) not in messages:
            on_task = node.attr in TASK_FILES | TASK_READS and _is_task_dir(node.value)
            if on_task or (node.attr in SPOOL_LISTS and _named(node.value, SPOOL_NAMES)):
                what = node.attr
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            folder, name = node.left, node.right
            if (
                isinstance(folder, ast.Attribute)
                and folder.attr == "path"
                and _is_task_dir(folder.value)
                and isinstance(name, ast.Constant)
                and name.value in FILE_NAMES
            ):
                what = str(name.value)
        elif isinstance(node, ast.ImportFrom) and node.module in STORE_INTERNALS:
            what = node.module
        elif isinstance(node, ast.Import):
            what = next((a.name for a in node.names if a.name in STORE_INTERNALS), None)
        if what is not None:
            found.append((getattr(node, "lineno", 0), what))
    return found


def violations(source: str, module: str) -> list[str]:
    """``reaches`` that ``ALLOWED`` does not name."""
    return [
        f"{module}:{line}: {what}"
        for line, what in reaches(source, module)
        if (module, what) not in ALLOWED
    ]


def _modules() -> list[tuple[str, Path]]:
    return [
        (path.relative_to(REPO).as_posix(), path)
        for root in SCANNED
        for path in sorted((REPO / root).rglob("*.py"))
        if not path.relative_to(REPO).as_posix().startswith(INSIDE)
    ]


def test_nothing_outside_the_store_reaches_a_task_file() -> None:
    found = [v for module, path in _modules() for v in violations(path.read_text(), module)]
    assert found == [], "task files reached outside worker/store/ (go through the store)"


def test_every_allowed_exception_is_still_needed() -> None:
    """An entry of ``ALLOWED`` that the code no longer needs is dropped, so the list says
    only what is true."""
    used = {(m, what) for m, path in _modules() for _, what in reaches(path.read_text(), m)}
    assert set(ALLOWED) - used == set()


def test_the_scan_finds_a_planted_violation() -> None:
    """The scan can fail: each way past the store, planted in a supervisor module."""
    planted = {
        "task.journal.stat().st_size": "journal",
        "slot.task.cancellation.exists()": "cancellation",
        "spool.task('t1').state.read_bytes()": "state",
        "atomic_write(parent.snapshot, b'')": "snapshot",
        "json.loads(worker.task.exit.read_text())": "exit",
        "(task.path / 'heartbeat.json').read_bytes()": "heartbeat.json",
        "open(slot.task.path / 'journal', 'rb')": "journal",
        "spec = task.load_spec()": "load_spec",
        "[t for t in self.spool.task_ids()]": "task_ids",
    }
    for line, attr in planted.items():
        assert violations(line, "supervisor/planted.py") == [f"supervisor/planted.py:1: {attr}"]
    assert violations("from worker.store.journal import read_file", "supervisor/x.py") == [
        "supervisor/x.py:1: worker.store.journal"
    ]
    assert violations("import worker.store.journal", "worker/x.py") == [
        "worker/x.py:1: worker.store.journal"
    ]
    # named in a message, a record's own state, or inside the store: no file is touched
    assert violations('raise E(f"{task.journal} is damaged")', "supervisor/x.py") == []
    assert violations("record.state == TaskStatus.DONE", "supervisor/x.py") == []
    assert violations("task.journal.stat()", "worker/x.py") != []


#: The modules of the backends: the supervisor names one only where it chooses its store.
#: PostgreSQL's are the store and its parts (its schema, ``pgschema``, is no backend: its
#: version is what ``agentd store init`` prints, and psycopg is not imported with it).
BACKEND_MODULES = frozenset(
    {
        "worker.store.files",
        "worker.store.memory",
        "worker.store.postgres",
        "worker.store.pgcoordination",
        "worker.store.pgdatabase",
        "worker.store.pgjournal",
        "worker.store.pgnodes",
        "worker.store.pgownership",
        "worker.store.pgtasks",
        "worker.store.pgtokens",
        "worker.store.pgview",
    }
)
#: What supervisor/ may import from a backend, each with its reason.
BACKEND_IMPORTS = {
    ("supervisor/stores.py", "spool_store"): "the one place the supervisor's store is chosen",
    ("supervisor/stores.py", "PostgresStore"): "the same, for a shared store",
    ("supervisor/submit.py", "refuse_symlinks"): "a task folder that is a symlink is refused "
    "before any step (the spool's folders, beside whichever store holds the bytes)",
}


def backend_imports(source: str, module: str) -> list[tuple[str, str]]:
    """The (module, name) pairs ``source`` imports from a backend module."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module in BACKEND_MODULES:
            found += [(module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(module, a.name) for a in node.names if a.name in BACKEND_MODULES]
    return found


def test_the_supervisor_chooses_its_store_in_one_place() -> None:
    """Everything else in supervisor/ works on the ``TaskStore`` Protocol (``store_for``,
    ``store_of``), so another backend is chosen in ``supervisor/stores.py`` alone."""
    used = [
        pair
        for path in sorted((REPO / "supervisor").rglob("*.py"))
        for pair in backend_imports(path.read_text(), path.relative_to(REPO).as_posix())
    ]
    assert [pair for pair in used if pair not in BACKEND_IMPORTS] == []
    assert set(BACKEND_IMPORTS) - set(used) == set()  # each exception still needed
    planted = "from worker.store.files import FileStore\nimport worker.store.postgres"
    assert backend_imports(planted, "supervisor/x.py") == [
        ("supervisor/x.py", "FileStore"),
        ("supervisor/x.py", "worker.store.postgres"),
    ]
