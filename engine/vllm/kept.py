"""Kept sets from vLLM by construction: :class:`SyncdKeptSets`, a vLLM logits processor that samples a replay
request's top-k/top-p itself with the shared rule the trainer replays (:func:`syncd.ops.replay.kept_sets`), and
:class:`ReplayArgs`, how a request asks for it (``SamplingParams.extra_args["syncd_replay"]``).

Where it runs: vLLM's sampler (``vllm/v1/sample/sampler.py``) divides the float32 logits by each request's
temperature, then calls the *argmax-invariant* logits processors, then applies its own top-k/top-p and draws.
This processor declares itself argmax-invariant, so it sees exactly the scaled logits ``z = logits / T`` the
replay format ranks (``docs/replay-format.md``). For every row of a replay request sampled at random it computes
the kept set with ``kept_sets(z, 1.0, top_k, top_p)`` (``z / 1.0`` is ``z`` bit for bit, so this is the shared rule
on the raw logits at temperature ``T``) and sets every other logit to ``-inf``. A replay request reaches vLLM with
top-p 1 and no top-k (:func:`syncd.engine.vllm.outputs.sampling_params`), so vLLM's own filters keep everything
and its draw is from the softmax over the kept set: the recorded set is the support vLLM sampled from, on any
device. Rows of other requests are not touched (their tokens are vLLM's own); greedy rows neither (vLLM takes
the argmax; their kept set is the sampled token).

What the processor computed for the last batch (:attr:`SyncdKeptSets.step`: per batch row the kept ids in rank
order, their gaps and their log-probabilities renormalised over the set) is read by the recorder
(:mod:`syncd.engine.vllm.recording`) once vLLM has sampled. The processor itself records nothing.

Threads: vLLM calls ``update_state``/``apply`` on its worker thread, one batch at a time.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from vllm.v1.sample.logits_processor.interface import BatchUpdate, LogitsProcessor, MoveDirectionality

__all__ = ["EXTRA_KEY", "GREEDY_BELOW", "PROCESSOR", "ReplayArgs", "KeptRow", "SyncdKeptSets", "replay_args_of"]

#: the ``SamplingParams.extra_args`` member a replay request carries
EXTRA_KEY = "syncd_replay"
#: the processor's import name (vLLM's ``logits_processors`` engine argument)
PROCESSOR = "syncd.engine.vllm.kept:SyncdKeptSets"
#: vLLM samples greedily below this temperature (``vllm.v1.sample.sampler._SAMPLING_EPS``)
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class ReplayArgs:
    """What a replay request asks of the processor: its syncd ``request_id`` (the replay records' key), the
    ``temperature`` (0: greedy), ``top_k`` (0: none) and ``top_p`` of the shared rule."""

    request_id: str
    temperature: float
    top_k: int
    top_p: float

    def to_extra(self) -> dict:
        return {"request_id": self.request_id, "temperature": self.temperature, "top_k": self.top_k,
                "top_p": self.top_p}

    @classmethod
    def from_extra(cls, d, vocab_size: int | None = None) -> "ReplayArgs":
        """Parse (and check) the ``extra_args`` member. Raises ValueError naming the field that is wrong."""
        if not isinstance(d, dict):
            raise ValueError(f"{EXTRA_KEY} must be an object, got {type(d).__name__}")
        rid, t, k, p = d.get("request_id"), d.get("temperature"), d.get("top_k"), d.get("top_p")
        if not isinstance(rid, str) or not rid:
            raise ValueError(f"{EXTRA_KEY}.request_id must be a non-empty string")
        check_sampling(t, k, p, vocab_size)
        return cls(rid, float(t), int(k), float(p))


def check_sampling(temperature, top_k, top_p, vocab_size: int | None = None) -> None:
    """The sampling settings a replay request may have. Raises ValueError naming the field: ``temperature``
    (finite, 0 or at least :data:`GREEDY_BELOW`, where vLLM samples at random), ``top_k`` (an integer, 0 or up to
    ``vocab_size``), ``top_p`` (in (0, 1])."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature) \
            or temperature < 0 or 0 < temperature < GREEDY_BELOW:
        raise ValueError(f"temperature must be 0 (greedy) or a finite number >= {GREEDY_BELOW} for replay, "
                         f"got {temperature!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0 or (vocab_size and top_k > vocab_size):
        limit = f" up to the vocabulary size {vocab_size}" if vocab_size else ""
        raise ValueError(f"top_k must be 0 (no limit) or an integer{limit}, got {top_k!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")


def replay_args_of(params) -> ReplayArgs | None:
    """The replay arguments of vLLM ``SamplingParams`` (None for a request without replay)."""
    extra = getattr(params, "extra_args", None)
    if not extra or EXTRA_KEY not in extra:
        return None
    return ReplayArgs.from_extra(extra[EXTRA_KEY])


@dataclass
class KeptRow:
    """One sampled row's kept set: ``ids`` in rank order (descending scaled logit, ties by the lower id),
    ``gaps`` (the scaled-logit gap after each rank, ``syncd.ops.replay.KeptSets.gaps``) and ``logprobs`` (of each
    kept id under the softmax over the set), numpy arrays (the recorder reads them without more torch calls)."""

    ids: np.ndarray
    gaps: np.ndarray
    logprobs: np.ndarray

    def logprob_of(self, token_id: int) -> float | None:
        hit = np.flatnonzero(self.ids == token_id)
        return float(self.logprobs[hit[0]]) if hit.size else None


class SyncdKeptSets(LogitsProcessor):
    """See the module docstring. ``rows``: the batch rows of replay requests and their :class:`ReplayArgs`;
    ``step``: the :class:`KeptRow` of each row the last :meth:`apply` masked (cleared by the reader)."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        self.rows: dict[int, ReplayArgs] = {}
        self.step: dict[int, KeptRow] = {}
        self.calls = 0
        self.seconds = 0.0  # spent in apply, in all

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        """Refuse (vLLM: HTTP 400) a replay request whose arguments are malformed, or whose vLLM top-p/top-k
        would filter again after the kept set."""
        args = replay_args_of(sampling_params)
        if args is None:
            return
        if sampling_params.top_p != 1.0 or sampling_params.top_k not in (0, -1):
            raise ValueError(f"a {EXTRA_KEY} request leaves top_p/top_k to syncd: vLLM's must be 1 and 0, got "
                             f"{sampling_params.top_p} and {sampling_params.top_k}")
        if abs(sampling_params.temperature - args.temperature) > 0:
            raise ValueError(f"{EXTRA_KEY}.temperature {args.temperature} is not the request's temperature "
                             f"{sampling_params.temperature}")

    def is_argmax_invariant(self) -> bool:
        """Masking outside a set that holds the largest logit never changes the argmax: vLLM runs this after the
        temperature and before its own top-k/top-p, only for random sampling."""
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for i in batch_update.removed:
            self.rows.pop(i, None)
        for i, params, _, _ in batch_update.added:
            args = replay_args_of(params)
            if args is None:
                self.rows.pop(i, None)
            else:
                self.rows[i] = args
        for a, b, direction in batch_update.moved:
            ra, rb = self.rows.pop(a, None), self.rows.pop(b, None)
            if ra is not None:
                self.rows[b] = ra
            if direction == MoveDirectionality.SWAP and rb is not None:
                self.rows[a] = rb

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        from syncd.ops.replay import kept_sets

        self.calls += 1
        rows = sorted(i for i, a in self.rows.items() if a.temperature > 0 and i < logits.shape[0])
        if not rows:
            return logits
        t0 = time.perf_counter()
        whole = len(rows) == logits.shape[0]  # every row (distinct, sorted): the logits themselves, masked in place
        index = None if whole else torch.tensor(rows, device=logits.device)
        z = logits if whole else logits.index_select(0, index)
        shared = {(self.rows[i].top_k, self.rows[i].top_p) for i in rows}
        if len(shared) == 1:  # scalars: kept_sets' few-op path for rows that share their parameters
            (top_k, top_p), = shared
        else:
            top_k, top_p = [self.rows[i].top_k for i in rows], [self.rows[i].top_p for i in rows]
        ks = kept_sets(z, 1.0, top_k, top_p)
        drop = torch.ones_like(z, dtype=torch.bool)
        drop[torch.repeat_interleave(torch.arange(len(rows), device=z.device), ks.offsets.diff(),
                                     output_size=ks.ids.numel()), ks.ids] = False
        z.masked_fill_(drop, float("-inf"))
        if not whole:
            logits.index_copy_(0, index, z)
        ids, gaps, lps = (t.cpu().numpy() for t in (ks.ids, ks.gaps, ks.logprobs))
        off = ks.offsets.tolist()
        self.step = {row: KeptRow(ids[off[j]:off[j + 1]], gaps[off[j]:off[j + 1]], lps[off[j]:off[j + 1]])
                     for j, row in enumerate(rows)}
        self.seconds += time.perf_counter() - t0
        return logits
