"""What a staged update is (``syncd.engines.WeightUpdater``): per local parameter, ascending positions and the old and
new words there (:class:`StagedParam`), and the update they make up (:class:`StagedUpdate`); the 64-bit
:func:`fingerprint` of staged words, so an apply on a GPU checks the words in place without sending the old ones;
and how it is written, all or nothing (:func:`write_staged`: CPU parameters by the native scatter, the others by
:func:`write_on_device`). The caller owns the tensors (the Adapter contract's one controller)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import numpy as np
import torch

from syncd.engines.params import word_view
from syncd.errors import DeltaError
from syncd.ops import scatter_words_

__all__ = ["StagedParam", "StagedUpdate", "fingerprint", "write_staged", "write_on_device", "mismatch"]


@dataclass
class StagedParam:
    """The staged words of one local parameter: ascending local flat ``index`` and the ``old`` and ``new``
    words there as same-width integers. CPU tensors; for a parameter on a GPU they are pinned, ``index`` is
    int32 when the parameter has fewer than 2^31 words (int64 otherwise, and always on the CPU), and
    ``old_fingerprint`` is :func:`fingerprint` of the old words, so an apply need not send them."""

    name: str
    index: torch.Tensor
    old: torch.Tensor
    new: torch.Tensor
    old_fingerprint: int | None = None

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """NumPy views (no copies) of ``index``, ``old`` and ``new``."""
        return self.index.numpy(), self.old.numpy(), self.new.numpy()


@dataclass
class StagedUpdate:
    """A staged (or last applied) update. ``prev_version`` is the version before it; ``expected_checksums``
    holds the local checksums the result must have where they are known without the full tensors (1:1
    parameters of a delta; every parameter of a full version)."""

    version: int
    prev_version: int | None
    kind: str
    params: list[StagedParam]
    epoch: int
    expected_checksums: dict[str, int] = field(default_factory=dict)

    @property
    def changed(self) -> int:
        """Number of local words that change."""
        return sum(p.index.numel() for p in self.params)

    @property
    def nbytes(self) -> int:
        """Staging memory in bytes."""
        return sum(p.index.nbytes + p.old.nbytes + p.new.nbytes for p in self.params)


# position·even + odd is odd, and an odd multiple of a nonzero word change is nonzero mod 2^64 (signed int64s)
_FP_ADD, _FP_MUL, _FP_POS = 0x632BE59BD9B4E019, 0x3C6EF372FE94F82A, 0xD6E8FEB86659FD93 - 2 ** 64


def _fingerprint_terms(words: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return (words.to(torch.int64) + _FP_ADD) * (index.to(torch.int64) * _FP_MUL + _FP_POS)


def fingerprint(words: torch.Tensor, index: torch.Tensor) -> int:
    """A 64-bit fingerprint of staged words at positions ``index`` (same device, any integer dtypes):
    the wrapping int64 sum of (word + a)·(position·b + c), b even and c odd, so every multiplier is odd and a
    change to any one word changes it; positions count. Torch arithmetic, identical on the CPU and a GPU."""
    return int(_fingerprint_terms(words, index).sum())


def mismatch(p: StagedParam, bad: int, version) -> DeltaError:
    """The error of an apply that found ``bad`` of ``p``'s staged words changed since ``version`` was staged."""
    return DeltaError(f"apply: parameter {p.name!r} changed since version {version} was staged (at least "
                      f"{bad} of its {p.index.numel()} staged words differ); nothing was written")


def _dev(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return t if t.device == like.device else t.to(like.device, non_blocking=True)


def write_on_device(flats, params: list[StagedParam], *, new: bool, verify: bool, version) -> None:
    """Write the new (``new``) or old words of ``params`` into their flat tensors ``flats`` (by name) with torch ops on
    each parameter's device (how ``WeightUpdater`` writes GPU parameters). Only positions and the words to write
    cross to the device (non-blocking from pinned memory): with ``verify`` the words in place are checked against
    the staged ones by :func:`fingerprint`, computed on the device and read back with one synchronisation per device
    (a mismatch is then counted exactly, sending the staged words, to name it). Nothing is written before every
    parameter passed, so a mismatch leaves the weights untouched; an error while writing puts back what was written.
    Raises ``DeltaError`` naming the parameter."""
    todo = []
    for p in params:
        bits = word_view(flats[p.name])
        n = p.index.numel()  # host memory; staged positions ascend, so the ends bound them all
        if n and not (0 <= int(p.index[0]) and int(p.index[n - 1]) < bits.numel()):
            raise DeltaError(f"apply: parameter {p.name!r} has a staged position outside the tensor; "
                             "nothing was written")
        after = p.new if new else p.old
        todo.append((p, bits, _dev(p.index, bits).long(), _dev(after, bits)))
    if verify and todo:
        sums: dict[torch.device, list] = {}
        for p, bits, idx, _ in todo:
            sums.setdefault(bits.device, []).append((p, _fingerprint_terms(bits[idx], idx).sum()))
        for pairs in sums.values():
            for (p, _), got in zip(pairs, torch.stack([t for _, t in pairs]).tolist()):
                before = p.old if new else p.new
                want = p.old_fingerprint if new and p.old_fingerprint is not None else fingerprint(before,
                                                                                                 p.index)
                if got != want:
                    bits = word_view(flats[p.name])
                    idx = _dev(p.index, bits).long()
                    raise mismatch(p, int((bits[idx] != _dev(before, bits)).sum()), version)
    done = []
    try:
        for p, bits, idx, after in todo:
            bits.index_copy_(0, idx, after)
            done.append((p, bits, idx))
    except BaseException:
        for p, bits, idx in done:
            bits.index_copy_(0, idx, _dev(p.old if new else p.new, bits))
        raise


_NATIVE_SCATTER = True  # CPU parameters through syncd.ops.scatter_words_ (tests turn it off to run the torch path)


def write_staged(flats: Mapping[str, torch.Tensor], words: Mapping[str, np.ndarray], params: list[StagedParam], *,
                 new: bool, verify: bool = False, version: int | None = None) -> None:
    """Scatter the new (``new``) or old words of every parameter into its flat tensor (``flats``, by name; ``words``:
    the NumPy word views of the CPU ones). With ``verify``, each position must hold the word being replaced. On any
    failure every word written so far is put back and nothing else is touched, then the error is raised
    (``DeltaError`` naming the parameter for a mismatch). CPU parameters: one :func:`syncd.ops.scatter_words_` over
    all of them (every core, each word compared just before it is written); the rest (GPU parameters, or every one
    with ``_NATIVE_SCATTER`` off): :func:`write_on_device`."""
    cpu = [p for p in params if p.name in words] if _NATIVE_SCATTER else []
    if cpu:
        failed = scatter_words_(_word_items(words, cpu, new), verify=verify)
        if failed is not None:
            p, bad = cpu[failed[0]], failed[1]
            if bad < 0:
                raise DeltaError(f"apply: parameter {p.name!r} has a staged position outside the tensor; "
                                 "nothing was written")
            raise mismatch(p, bad, version)
    try:
        write_on_device(flats, [p for p in params if p.name not in words or not _NATIVE_SCATTER],
                        new=new, verify=verify, version=version)
    except BaseException:
        if cpu:
            scatter_words_(_word_items(words, cpu, not new), verify=False)
        raise


def _word_items(views: Mapping[str, np.ndarray], params: list[StagedParam], new: bool) -> list:
    """``syncd.ops.scatter_words_`` items of CPU parameters (``views``: their word arrays): the new (``new``) or
    the old words over the others."""
    items = []
    for p in params:
        i, o, n = p.arrays()
        items.append((views[p.name], i, o, n) if new else (views[p.name], i, n, o))
    return items
