"""The applications: the ``syncd`` command line (:mod:`syncd.app.cli`), the weight-sync demo
(:mod:`syncd.app.demo`), the RL demo (:mod:`syncd.app.rl_demo`) and its serving stack (:mod:`syncd.app.rl_stack`).

The one part of the ``syncd`` package that wires the core together with ``engine`` and ``trainer`` (the layers
are checked by import-linter: ``pyproject.toml``, ``docs/architecture.md``); nothing else in ``syncd`` imports it.
"""
