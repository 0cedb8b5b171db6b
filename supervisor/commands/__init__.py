"""The commands of ``agentd``, a module per group: ``daemon`` (start, stop, demo, unit),
``tasks`` (submit, status, logs, show, history), ``run`` (a task in the foreground),
``interventions`` (what an operator does to a task: cancel, retry, budget, held calls,
rewind, fork), ``cluster`` (nodes, store), ``console`` (its login and API tokens) and
``setup`` (init, config check, tools). Each declares its commands and their arguments in
an ``add_parser`` function (``parsing.Commands``); ``supervisor.cli`` assembles the parser
from them and runs the one asked for.
"""
