"""The trainer state's tree (nested dicts, lists, tuples, tensors, numpy arrays, JSON scalars) as tensors plus a
JSON skeleton, and back: what goes into a bundle's ``optim.safetensors`` and ``state.json``
(:mod:`syncd.trainer.ft.ckpt_format`). Nothing is ever unpickled.

:func:`flatten` turns any such nesting into ``(tensors, skeleton)``: the tensors by path, and a JSON skeleton in
which a tensor is ``{"t": path}``, a float ``{"f": float.hex()}`` (exact, no NaN/inf trouble), a dict ``{"d":
[[key, value], ...]}``, a list ``{"l": [...]}``, a tuple ``{"u": [...]}``, a numpy array ``{"n": path}``;
:func:`unflatten` inverts it and refuses any other shape (StateError naming the node).

Pure functions; thread-safe.
"""

from __future__ import annotations

import numpy as np
import torch

from syncd.trainer.ft.ckpt_format import StateError

__all__ = ["flatten", "unflatten"]


def _escape(key) -> str:
    return str(key).replace("%", "%25").replace("/", "%2F")


def flatten(obj, prefix: str = "") -> tuple[dict[str, torch.Tensor], object]:
    """``(tensors by path, JSON skeleton)`` of ``obj`` (see the module docstring). TypeError for anything else."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(x, path):
        if isinstance(x, torch.Tensor):
            tensors[path] = x.detach()
            return {"t": path}
        if isinstance(x, np.ndarray):
            tensors[path] = torch.from_numpy(np.ascontiguousarray(x))
            return {"n": path}
        if isinstance(x, bool) or x is None or isinstance(x, str):
            return x
        if isinstance(x, int):
            return int(x)
        if isinstance(x, float):
            return {"f": float(x).hex()}
        if isinstance(x, dict):
            items = []
            for k, v in x.items():
                if isinstance(k, bool) or not isinstance(k, (str, int)):
                    raise TypeError(f"{path or '<root>'}: dict key {k!r} is neither str nor int")
                items.append([k, walk(v, f"{path}/{_escape(k)}" if path else _escape(k))])
            return {"d": items}
        if isinstance(x, (list, tuple)):
            body = [walk(v, f"{path}/{i}" if path else str(i)) for i, v in enumerate(x)]
            return {"l" if isinstance(x, list) else "u": body}
        if isinstance(x, (np.integer, np.floating)):
            return walk(x.item(), path)
        raise TypeError(f"{path or '<root>'}: cannot store a {type(x).__name__}")

    skeleton = walk(obj, prefix)
    return tensors, skeleton


def unflatten(skeleton, tensors: dict[str, torch.Tensor], *, where: str = "state", max_depth: int = 48):
    """The object :func:`flatten` was given. StateError for a node of another shape or a missing tensor."""

    def bad(msg):
        raise StateError(f"{where}: {msg}")

    def walk(x, depth):
        if depth > max_depth:
            bad(f"nested deeper than {max_depth}")
        if x is None or isinstance(x, (bool, str)) or (isinstance(x, int) and not isinstance(x, bool)):
            return x
        if not isinstance(x, dict) or len(x) != 1:
            bad(f"malformed node {str(x)[:80]!r}")
        (tag, v), = x.items()
        if tag in ("t", "n"):
            if not isinstance(v, str) or v not in tensors:
                bad(f"tensor {str(v)[:80]!r} is missing")
            return tensors[v] if tag == "t" else tensors[v].numpy()
        if tag == "f":
            try:
                return float.fromhex(v)
            except (TypeError, ValueError):
                bad(f"float {str(v)[:40]!r} is not a hex float")
        if tag == "d" and isinstance(v, list):
            out = {}
            for item in v:
                if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], (str, int))
                        and not isinstance(item[0], bool)):
                    bad("malformed dict item")
                out[item[0]] = walk(item[1], depth + 1)
            return out
        if tag in ("l", "u") and isinstance(v, list):
            body = [walk(i, depth + 1) for i in v]
            return body if tag == "l" else tuple(body)
        bad(f"unknown node {tag!r}")

    return walk(skeleton, 0)
