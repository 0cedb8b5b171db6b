# Every target bootstraps .venv itself, so a bare machine with Python 3.11+ and make is enough.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# The MCP servers from npm that the tests run (tests/mcp/package.json, its lock file)
NPM_STAMP := tests/mcp/node_modules/.installed

.PHONY: demo demo-cluster demo-run test test-tmp-checkout system-tools mcp-servers lint typecheck unit bench chaos man clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	@# byte-compiled, as pip compiles a package it installs: an editable install where
	@# PYTHONDONTWRITEBYTECODE is set would compile every module at every command and
	@# at every fresh worker's start
	$(BIN)/python -m compileall -q agentd worker supervisor > /dev/null
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/agentd demo

# `agentd run` killed partway (kill -9) and carried to completion with --resume.
demo-run: $(STAMP)
	AGENTD=$(BIN)/agentd sh examples/run-demo.sh

# Two nodes on a throwaway PostgreSQL (needs the server binaries: apt-get install postgresql).
demo-cluster: $(STAMP)
	$(BIN)/agentd demo --cluster

# The man page, rendered from the argument parser (see it with `man -l agentd.1`).
man: agentd.1

agentd.1: $(STAMP) supervisor/cli.py $(wildcard supervisor/commands/*.py) supervisor/clidoc.py supervisor/manpage.py
	$(BIN)/python -m supervisor.manpage man > $@

lint: $(STAMP)
	$(BIN)/ruff check agentd worker supervisor tests bench
	$(BIN)/ruff format --check agentd worker supervisor tests bench

typecheck: $(STAMP)
	$(BIN)/mypy

unit: $(STAMP) $(NPM_STAMP)
	$(BIN)/pytest -q

# The npm MCP servers the tests run (@modelcontextprotocol/server-filesystem and
# server-everything), exactly as the lock file says; node and npm are Debian's (nodejs, npm).
mcp-servers: $(NPM_STAMP)

$(NPM_STAMP): tests/mcp/package.json tests/mcp/package-lock.json
	cd tests/mcp && npm ci --no-audit --no-fund --loglevel=error
	touch $(NPM_STAMP)

# The system tools the suite drives (git, strace, bwrap, libfaketime, PostgreSQL, ...):
# installed as root with apt-get, otherwise named with the line that installs them.
# AGENTD_TEST_SYSTEM=skip runs the rest without them (never under CI=true).
system-tools:
	@.ci/system-tools

test: system-tools mcp-servers lint typecheck unit

# Where many first try a project (`cd /tmp && git clone`): the sandbox, MCP and unit tests
# again from a clone of HEAD under /tmp, with its own venv and node_modules there, which
# the sandbox's own /tmp and the unit's PrivateTmp= must not hide (a few minutes).
TMP_CHECKOUT_TESTS := tests/worker/test_sandbox.py tests/worker/test_mcp_tasks.py \
	tests/worker/test_mcp_servers.py tests/supervisor/test_mcp_cli.py \
	tests/supervisor/test_systemd_unit.py tests/test_unitjail.py
test-tmp-checkout:
	@set -e; folder=$$(mktemp -d /tmp/agentd-checkout.XXXXXX); trap 'rm -rf "$$folder"' EXIT; \
	git clone --quiet . "$$folder/agentd"; cd "$$folder/agentd"; \
	$(MAKE) --no-print-directory $(STAMP) mcp-servers; \
	$(BIN)/pytest -q -p no:cacheprovider $(TMP_CHECKOUT_TESTS)

bench: $(STAMP)
	$(BIN)/python -m bench --full

# The full fault campaign, every class of docs/results/reliability.md in one table
# (about an hour on 2 cores): 500 kill -9 trials, every crash point, every I/O error,
# every torn byte, compound failures, daemon kills under load, hangs, API faults, load,
# thousands of fuzz cases, the security checks.
chaos: $(STAMP)
	$(BIN)/python -m tests.chaos --full

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache agentd.1 tests/mcp/node_modules
