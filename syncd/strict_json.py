"""Bounded strict JSON for everything syncd reads from a store, a file or a local socket.

:func:`loads` is the one parser for such bytes (manifests, the ``latest.json`` hint, engine control bodies):
it refuses, with the error class the caller names and a message that starts with ``where``,

* input over ``max_bytes`` (checked before anything is decoded),
* anything but ASCII (or UTF-8 with ``ascii=False``), NaN/Infinity, floats unless ``floats=True``,
  duplicate object members,
* nesting deeper than ``max_depth`` (the C parser stops a hostile ``"[" * 10**6`` at Python's recursion
  limit, in microseconds, and the result is then walked iteratively),
* a top level that is not an object (``want=dict``) when asked.

Pure and thread-safe.
"""

from __future__ import annotations

import json

from syncd.errors import MalformedObject

DEFAULT_MAX_DEPTH = 32


def _depth(doc) -> int:
    """Deepest nesting of lists and objects in a parsed document (iterative: no recursion)."""
    deepest, todo = 0, [(doc, 1)]
    while todo:
        node, depth = todo.pop()
        if isinstance(node, (list, dict)):
            deepest = max(deepest, depth)
            todo.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def loads(raw, *, where: str, max_bytes: int, max_depth: int = DEFAULT_MAX_DEPTH, floats: bool = False,
          ascii: bool = True, want: type | None = dict, error: type[Exception] = MalformedObject):
    """Parse ``raw`` (bytes-like) as strict JSON within the bounds above; raises ``error(where + ": ...")``."""
    raw = bytes(raw)
    if len(raw) > max_bytes:
        raise error(f"{where}: {len(raw)} bytes, over the {max_bytes}-byte limit")

    def no_dupes(pairs):
        out = {}
        for k, v in pairs:
            if k in out:
                raise error(f"{where}: duplicate member {k!r:.80} in JSON")
            out[k] = v
        return out

    def no_float(text):
        raise error(f"{where}: non-integer number {text[:40]!r} in JSON; only integers are allowed here")

    try:
        text = raw.decode("ascii" if ascii else "utf-8")
        doc = json.loads(text, object_pairs_hook=no_dupes, parse_constant=no_float,
                         **({} if floats else {"parse_float": no_float}))
    except error:
        raise
    except RecursionError:
        raise error(f"{where}: JSON nested deeper than the parser's recursion limit (limit {max_depth})") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise error(f"{where}: not valid JSON: {str(exc)[:200]}") from None
    depth = _depth(doc)
    if depth > max_depth:
        raise error(f"{where}: JSON nested {depth} deep, over the limit of {max_depth}")
    if want is not None and not isinstance(doc, want):
        name = "object" if want is dict else want.__name__
        raise error(f"{where}: not a JSON {name} (a {type(doc).__name__})")
    return doc


def dumps(obj) -> bytes:
    """Canonical encoding: sorted keys, no whitespace, ASCII escapes, no NaN (``ValueError``)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()
