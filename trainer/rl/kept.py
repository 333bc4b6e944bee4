"""Rebuilding the kept sets an engine recorded by size and fingerprint (``docs/trainer-replay.md``).

An engine recording with a tolerance ``delta`` lists a kept set only where its ranking is fragile; elsewhere it
records the set as "the first ``m`` ranks of my logits" (plus a few listed ids) and a 32-bit fingerprint. The
trainer rebuilds such a set from its own logits of the same position with the engine's ranking rule
(``syncd.ops.replay.kept_sets``, shared with the engine's sampler) and verifies the fingerprint. That is exact when
its scaled logits are within ``delta`` of the engine's each, i.e. computed on the weights version that sampled the
token: on-policy from the training forward itself, otherwise from a recomputation on that version
(:func:`syncd.trainer.rl.logprobs.resolve_kept`). A set that does not verify is never used: :class:`KeptRebuildError`,
or with ``on_mismatch="drop"`` the token is marked invalid and counted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from syncd.ops.replay import REBUILD_OK, REBUILD_OVERLAP, kept_rows, rebuild_kept
from syncd.trainer.rl.rollouts import KeptSetError, PendingKept, RolloutError

__all__ = ["KeptRebuildError", "FilledKept", "fill_kept"]


class KeptRebuildError(RolloutError):
    """A recorded kept set is not what the trainer's logits rebuild (another size or fingerprint): those logits
    differ from the engine's by more than its tolerance, or are of other weights than the version that sampled
    the token."""


@dataclass
class FilledKept:
    """Every generated token's kept set (CSR ``ids`` int64, ascending per row, ``offsets`` ``[G + 1]``);
    ``valid`` (bool ``[G]``): False where a set could not be rebuilt (``on_mismatch="drop"``; that row holds the
    target alone and must not be trained on); ``rebuilt``: sets rebuilt and verified; ``mismatches``: not."""

    ids: torch.Tensor
    offsets: torch.Tensor
    valid: torch.Tensor
    rebuilt: int
    mismatches: int


def fill_kept(ids: torch.Tensor, offsets: torch.Tensor, pending: PendingKept | None, logits: torch.Tensor,
              targets: torch.Tensor, temperatures, *, on_mismatch: str = "raise", versions=None,
              backend: str = "auto") -> FilledKept:
    """The kept sets of ``G`` generated tokens: the listed ones (CSR ``ids``/``offsets``, empty rows where
    ``pending`` has a set to rebuild) and those of ``pending`` rebuilt from ``logits`` (``[G, V]``, the rows that
    predict each generated token; only the pending rows are read, not differentiated). ``targets``: the sampled
    tokens; ``temperatures``: number or ``[G]`` (for the margins in messages); ``versions`` (``[G]``, optional):
    named in messages.

    Raises :class:`KeptRebuildError` for a set that does not verify (``on_mismatch="raise"``) and
    :class:`~syncd.trainer.rl.rollouts.KeptSetError` for a verified set without its sampled token (a bad record)."""
    if on_mismatch not in ("raise", "drop"):
        raise ValueError("on_mismatch must be 'raise' or 'drop'")
    G = offsets.numel() - 1
    dev = logits.device
    valid = torch.ones(G, dtype=torch.bool, device=dev)
    if pending is None or not len(pending):  # every set listed: used as it is
        return FilledKept(ids.to(dev), offsets.to(dev), valid, 0, 0)
    ids, offsets, targets = ids.to(dev, torch.int64), offsets.to(dev), targets.to(dev, torch.int64)
    p = pending.to(dev)
    if bool((offsets[p.rows + 1] != offsets[p.rows]).any()):
        raise ValueError("fill_kept: rows to rebuild must be empty in the listed kept sets")
    temps = torch.as_tensor(temperatures, dtype=torch.float32, device=dev)
    temps = temps.expand(G) if temps.dim() == 0 else temps
    rb = rebuild_kept(logits.detach()[p.rows], p.top, p.extra_ids, p.extra_offsets, p.fingerprints, temps[p.rows],
                      backend=backend)
    ok = rb.status == REBUILD_OK
    V = logits.shape[1]
    rb_rows = kept_rows(rb.offsets)
    hit = torch.zeros(len(p), dtype=torch.int64, device=dev).index_add_(
        0, rb_rows, (rb.ids == targets[p.rows][rb_rows]).to(torch.int64))
    lost = ok & (hit == 0)
    if bool(lost.any()):
        j = int(lost.nonzero()[0])
        size = int(rb.offsets[j + 1] - rb.offsets[j])
        raise KeptSetError(f"generated token {int(p.rows[j])}: the rebuilt kept set ({size} ids, fingerprint "
                           f"verified) does not contain the sampled token {int(targets[p.rows[j]])}")
    bad = (~ok).nonzero()[:, 0]
    if bad.numel() and on_mismatch == "raise":
        j = int(bad[0])
        row = int(p.rows[j])
        what = "its extra ids overlap those ranks" if int(rb.status[j]) == REBUILD_OVERLAP else "another fingerprint"
        ver = "" if versions is None else f" (sampled with version {int(versions[row])})"
        raise KeptRebuildError(
            f"{bad.numel()} of {len(p)} kept sets to rebuild do not match these logits; the first, generated token "
            f"{row}{ver}: the recorded set of {int(rb.offsets[j + 1] - rb.offsets[j])} ids is not the first "
            f"{int(p.top[j])} ranks of these logits plus its listed ids ({what}; the logits' own margin there is "
            f"{float(rb.margin[j]):.3g}, the engine's tolerance {float(p.tolerances[j]):.3g}): these logits differ "
            "from the engine's by more than its tolerance, or are of other weights than the version that sampled "
            "the token (rebuild from that version's logits: syncd.trainer.rl.logprobs.resolve_kept)")
    # rows that did not verify keep the target alone (valid False); the others their rebuilt set
    sizes = torch.where(ok, rb.offsets[1:] - rb.offsets[:-1], torch.ones_like(p.top))
    keep = ok[rb_rows]
    new_rows = torch.cat([p.rows[rb_rows[keep]], p.rows[~ok]])
    new_ids = torch.cat([rb.ids[keep], targets[p.rows[~ok]]])
    valid[p.rows[~ok]] = False
    listed_rows = kept_rows(offsets)
    key, _ = torch.sort(torch.cat([listed_rows * V + ids, new_rows * V + new_ids]))
    counts = (offsets[1:] - offsets[:-1]).clone()
    counts[p.rows] = sizes
    return FilledKept(key % V, torch.cat([counts.new_zeros(1), counts.cumsum(0)]), valid, int(ok.sum()),
                      int(bad.numel()))
