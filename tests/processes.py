"""Which tests are process tests: the ``process`` marker, applied at collection.

A test is a process test when it starts a real process: a daemon, a fork server, a worker,
a campaign, a server, or any program through ``subprocess``. The suite does not rely on
each test saying so. ``tests/conftest.py`` marks a test when its function, one of its
fixtures, or a helper of the suite's either of them calls, starts a process: the names
each code object refers to are followed through the ``tests`` package (functions and the
methods of classes) until they reach a starter (``subprocess``, ``multiprocessing``,
``os.fork`` and its kin, or a module of the product's that spawns). A test may also say
``pytest.mark.process`` itself, where it starts one in a way this walk cannot see (a module
imported by name).

``pytest -m "not process"`` is then the fast unit suite; ``pytest -m process`` the rest.
"""

from __future__ import annotations

import functools
import inspect
import multiprocessing
import os
import subprocess
import types
from collections.abc import Iterator
from typing import Any

import pytest

from tests.daemon import subreaper

#: Modules a reference to which starts processes.
STARTER_MODULES = frozenset({subprocess, multiprocessing})
#: Attributes of ``os`` that start one.
OS_STARTERS = frozenset({"fork", "forkpty", "posix_spawn", "posix_spawnp", "system", "popen"})
#: Modules of the product's whose objects start processes when called: the fork servers,
#: the worker launcher, the PostgreSQL cluster helper, the demo, the console's browser and
#: the MCP servers.
PRODUCT_STARTERS = frozenset(
    {
        "worker.forkserver",
        "supervisor.forkserver",
        "supervisor.workers",
        "supervisor.pgcluster",
        "supervisor.demo",
        "supervisor.console.process",
        "worker.mcp.servers",
    }
)

#: Fixtures that only a process test asks for.
FIXTURES = frozenset({"subreaper", "postgres_url", "postgres_schema"})


def is_process_test(item: pytest.Item) -> bool:
    """True when ``item`` (a test function) or a fixture it uses starts a process."""
    if item.get_closest_marker("process") is not None:
        return True
    if FIXTURES & set(getattr(item, "fixturenames", ())):
        return True
    function = getattr(item, "function", None)
    if function is not None and _starts(function):
        return True
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    for name in info.names_closure:
        for fixturedef in info.name2fixturedefs.get(name, ()):
            if _starts(fixturedef.func):
                return True
    return False


#: What is known of each function and class seen (one under study counts as not starting
#: anything, so that a cycle of references ends).
_KNOWN: dict[Any, bool] = {}


def _starts(obj: Any) -> bool:
    return _starts_cached(_unwrap(obj))


def _starts_cached(obj: Any) -> bool:
    if obj not in _KNOWN:
        _KNOWN[obj] = False
        _KNOWN[obj] = _starts_class(obj) if inspect.isclass(obj) else _starts_code(obj)
    return _KNOWN[obj]


def _starts_code(obj: Any) -> bool:
    code = getattr(obj, "__code__", None)
    if code is None:
        return False
    namespace = getattr(obj, "__globals__", {})
    for names in _names(code):
        if "os" in names and namespace.get("os") is os and names & OS_STARTERS:
            return True
        for name in names:
            if name not in namespace:
                continue
            value = namespace[name]
            if _is_starter(value):
                return True
            # module.helper(), BWRAP.daemon(): what is reached through a module or an object
            holder = _in_tests(value) and not (inspect.isfunction(value) or inspect.isclass(value))
            if holder and any(_is_starter(getattr(value, attr, None)) for attr in names):
                return True
    return False


def _starts_class(cls: type) -> bool:
    for value in [v for c in cls.__mro__ if _in_tests(c) for v in vars(c).values()]:
        target = value.fget if isinstance(value, property) else value
        if isinstance(target, staticmethod | classmethod):
            target = target.__func__
        if inspect.isfunction(target) and _starts_cached(target):
            return True
    return False


def _is_starter(value: Any) -> bool:
    """True when a global a code object names starts processes, by itself or by what it
    refers to (followed only inside the ``tests`` package)."""
    if isinstance(value, types.ModuleType):
        return value in STARTER_MODULES
    module = getattr(value, "__module__", None) or ""
    if module in PRODUCT_STARTERS:
        return True
    if not _in_tests(value):
        return False
    value = _unwrap(value)
    if value is subreaper:  # (it starts none, but only a test that does asks for it)
        return True
    if inspect.isfunction(value) or inspect.isclass(value):
        return _starts_cached(value)
    return _in_tests(type(value)) and _starts_cached(type(value))  # an instance: BWRAP.daemon()


def _in_tests(value: Any) -> bool:
    """True for a module, function or class of the ``tests`` package."""
    name = (
        value.__name__
        if isinstance(value, types.ModuleType)
        else getattr(value, "__module__", None)
    )
    return isinstance(name, str) and name.split(".")[0] == "tests"


def _names(code: types.CodeType) -> Iterator[frozenset[str]]:
    """The names each code object (``code`` and those nested in it) refers to."""
    yield frozenset(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _names(const)


def _unwrap(obj: Any) -> Any:
    obj = getattr(obj, "__func__", obj)  # a bound method
    while isinstance(obj, functools.partial):
        obj = obj.func
    return inspect.unwrap(obj) if callable(obj) else obj
