"""One ``--help`` style for every syncd command line: each flag's default shown after its help.

Commands pass ``formatter_class=HelpFormatter`` to ``argparse.ArgumentParser``. A flag whose default is empty
(None, False: a switch that is off) shows none; a help text that already says its default
(``"(default: ...)"``) is left as it is."""

from __future__ import annotations

import argparse

__all__ = ["HelpFormatter"]


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with each flag's default, except the empty ones (None, False: a switch that is off)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (action.default is None or action.default is False or action.default is argparse.SUPPRESS
                or "default" in text):
            return action.help
        return super()._get_help_string(action)
