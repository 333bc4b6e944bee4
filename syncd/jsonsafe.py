"""Bounded, strict JSON for everything that comes from outside the process (the store, a peer, a local file,
an HTTP client).

:func:`loads` checks, in this order and before anything is built from the text: the size (``max_bytes``),
the nesting depth (``max_depth``, measured with a few linear passes of C string operations, so a forged
``"[" * 10**6`` never reaches the recursive parser), the text encoding (UTF-8, or ASCII with
``ascii_only``); then it parses with hooks that refuse what the strict encoder (``allow_nan=False``) could
never write back -- ``NaN``, ``Infinity``, ``-Infinity`` and numbers that overflow to infinity -- and,
optionally, every non-integer number (``floats=False``) and duplicate object members
(``unique_members=True``). Whatever is wrong raises one named error (``error``, :class:`JSONError` by
default) whose message starts with ``what`` and says what was wrong. A value :func:`loads` returns can be
encoded again with ``json.dumps(..., allow_nan=False)``, nested inside a few more levels.

Pure functions; thread-safe.
"""

from __future__ import annotations

import json
import math

from syncd.errors import SyncdError

__all__ = ["JSONError", "loads", "too_deep", "MAX_DEPTH"]

#: the default nesting bound: far below the interpreter's recursion limit, far above any message of ours
MAX_DEPTH = 64

_KEEP = b'"[]{}'
_DROP = bytes(b for b in range(256) if b not in _KEEP)


class JSONError(SyncdError, ValueError):
    """JSON text from outside is too large, nested too deep, not valid (strict) JSON, or holds a value the
    caller does not accept; the message says which."""


def too_deep(raw: bytes, max_depth: int) -> bool:
    """True if the arrays and objects of JSON text ``raw`` nest more than ``max_depth`` levels (brackets
    inside strings do not count). Text that is not JSON may be answered either way; the parser then refuses
    it. Cost: four C passes over ``raw``, then numpy passes over its brackets and the quotes of the strings
    that contain brackets (a tenth of a parse or less)."""
    marks = raw.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _DROP)  # every '"' left delimits
    marks = marks.replace(b'""', b"")  # strings without brackets (and the seams between strings) vanish
    if len(marks) <= max_depth:
        return False
    import numpy as np

    a = np.frombuffer(marks, dtype=np.uint8)
    step = _step_table(np)[a]
    if b'"' in marks:  # strings with brackets inside: only brackets outside them count
        step *= (np.cumsum(a == ord('"'), dtype=np.int32) & 1) == 0
    return int(np.cumsum(step, dtype=np.int32).max()) > max_depth


def _step_table(np):
    table = np.zeros(256, dtype=np.int8)
    table[list(b"[{")] = 1
    table[list(b"]}")] = -1
    return table


def loads(raw, *, what: str, max_bytes: int, max_depth: int = MAX_DEPTH, floats: bool = True,
          ascii_only: bool = False, unique_members: bool = False, error: type[ValueError] = JSONError):
    """The JSON value in ``raw`` (bytes-like), checked as the module docstring says; raises ``error``."""
    if len(raw) > max_bytes:
        raise error(f"{what}: {len(raw)} bytes of JSON, over the limit of {max_bytes}")
    raw = bytes(raw)
    if too_deep(raw, max_depth):
        raise error(f"{what}: JSON nested deeper than {max_depth} levels")
    try:
        text = raw.decode("ascii" if ascii_only else "utf-8")
    except UnicodeDecodeError as exc:
        encoding = "ASCII" if ascii_only else "UTF-8"
        raise error(f"{what}: not {encoding} text ({exc.reason} at byte {exc.start})") from None

    def constant(name):
        raise error(f"{what}: {name} is not a JSON value (a strict encoder cannot write it)")

    def number(text_):
        if not floats:
            raise error(f"{what}: non-integer number {text_[:20]!r}; none is allowed here")
        value = float(text_)
        if not math.isfinite(value):
            raise error(f"{what}: number {text_[:20]!r} overflows to infinity")
        return value

    def members(pairs):
        out = {}
        for k, v in pairs:
            if k in out:
                raise error(f"{what}: duplicate member {k[:40]!r}")
            out[k] = v
        return out

    try:
        return json.loads(text, parse_constant=constant, parse_float=number,
                          object_pairs_hook=members if unique_members else None)
    except error:
        raise
    except (ValueError, RecursionError) as exc:
        raise error(f"{what}: not valid JSON: {exc}") from None
