"""Refusing to publish weights that are not finite.

A trainer that diverged (a learning rate too high, a loss that overflowed) holds NaN or +-inf weights; published,
every engine would apply them and serve garbage. :class:`~syncd.publish.publisher.WeightPublisher` checks every
snapshot with :func:`check_finite` before it encodes anything -- after the cast to the serving dtype, so a float32
value too large for bfloat16 counts as the inf it would become. A non-finite snapshot raises
:class:`NonFiniteWeights` there: nothing of it reaches the store, the engines keep serving the last good version,
and the trainer hears the error (as the ``__cause__`` of :class:`~syncd.errors.PublishError`) from its next
``publish``/``flush``/``close``.

Cost: one read of the snapshot on its device, a min/max reduction of each slice of :data:`SLICE_ELEMS` elements
(``torch.aminmax`` propagates NaN, so a slice is finite exactly when its minimum and maximum are; no mask is
allocated), and one host synchronisation per device. Only a snapshot that fails reads its offending tensor again,
for the message.
"""

from __future__ import annotations

import torch

from syncd.errors import PublishError

__all__ = ["NonFiniteWeights", "check_finite", "SLICE_ELEMS"]

#: elements checked at once (the boolean mask of a slice is this many bytes)
SLICE_ELEMS = 1 << 26


class NonFiniteWeights(PublishError, ValueError):
    """A snapshot holds NaN or +-inf values: it is not published. The message names the first such tensor,
    how many of its values are not finite, and the first one's index."""


def _bad_mask(t: torch.Tensor) -> torch.Tensor:
    """``~isfinite`` of a 1-D slice (float8 kinds without an ``isfinite`` kernel go through float32)."""
    try:
        return ~torch.isfinite(t)
    except (RuntimeError, NotImplementedError):
        return ~torch.isfinite(t.float())


def _slice_finite(t: torch.Tensor) -> torch.Tensor:
    """Whether a 1-D slice holds only finite values, as a 0-d bool tensor on its device: its minimum and maximum
    are both finite (``torch.aminmax`` returns NaN for both when any value is NaN); float8 kinds without the
    kernel go through float32, which holds each of their values exactly."""
    try:
        lo, hi = torch.aminmax(t)
    except (RuntimeError, NotImplementedError):
        lo, hi = torch.aminmax(t.float())
    return torch.isfinite(lo) & torch.isfinite(hi)


def _slices(t: torch.Tensor):
    flat = t.detach().reshape(-1)
    for start in range(0, flat.numel(), SLICE_ELEMS):
        yield start, flat[start:start + SLICE_ELEMS]


def check_finite(tensors: dict, *, what: str = "the snapshot") -> None:
    """Raise :class:`NonFiniteWeights` if a floating-point tensor of ``tensors`` (name -> tensor) holds a NaN or
    an infinity; integer and boolean tensors are always finite. ``what`` names the weights in the message."""
    flags, where = [], []
    for name, t in tensors.items():
        if not t.is_floating_point() or t.numel() == 0:
            continue
        for start, part in _slices(t):
            flags.append(_slice_finite(part))
            where.append((name, start))
    if not flags:
        return
    by_device: dict = {}
    for i, f in enumerate(flags):
        by_device.setdefault(f.device, []).append(i)
    bad = sorted(i for idx in by_device.values() for i, ok in zip(idx, torch.stack([flags[i] for i in idx]).tolist())
                 if not ok)
    if not bad:
        return
    name, _ = where[bad[0]]
    t = tensors[name]
    count, first, value = 0, None, None
    for start, part in _slices(t):
        mask = _bad_mask(part)
        n = int(mask.sum())
        if n and first is None:
            j = int(mask.nonzero()[0, 0])
            first, value = start + j, float(part[j].float())
        count += n
    others = len({where[i][0] for i in bad}) - 1
    raise NonFiniteWeights(
        f"non-finite weights in {what}: tensor {name!r} ({str(t.dtype).removeprefix('torch.')}"
        f"{list(t.shape)}) has {count} of {t.numel()} values NaN or +-inf (the first at flat index {first}: {value})"
        + (f", and {others} more tensor(s) too" if others else "")
        + "; nothing of it is published: the engines keep serving the last good version")
