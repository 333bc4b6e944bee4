"""The SWE-check bug-detection reward behind the thin trainer's reward interface
(:data:`syncd.trainer.rl.tasks.RewardFn`).

:class:`SWECheckReward` turns one :class:`syncd.trainer.rl.tasks.Sample` into a float, the seed's recipe end to end:

1. ``parse(sample.completion)`` -> the predicted bugs (your parser of the model's report);
2. the ground truth is ``sample.item.meta[truth_key]`` (the task item carries it; it is recorded with every
   trajectory of the item);
3. :func:`~syncd.trainer.rewards.score_sample` (scope judge, maximum one-to-one matching) -> P(tau), R(tau);
4. the linearized F_beta reward ``a * P + R`` (:class:`~syncd.trainer.rewards.LinearizedReward`), divided by ``a + 1``
   so that it lies in [0, 1] unless ``normalize=False``;
5. optionally the SWE-1.7 rules: 0 when ``cheated(sample)``, the alternating length penalty at the sample's
   trainer step (``length_penalty``, costs from ``cost(sample) -> (tokens, turns, tool_time_s)``, by default
   read from the sample's trajectory record, ``syncd.trainer.rewards.record.record_cost``: its generated tokens,
   turns and tool wall time), and the latency phase (``two_phase``, a
   :class:`~syncd.trainer.rewards.TwoPhaseReward` over the same tokens and the turns that called a tool).

Bad input raises :class:`~syncd.trainer.rewards.RewardInputError` (a ``ValueError``): the rollout worker then drops the
group and counts a ``reward`` failure rather than training on a made-up number.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ._validate import RewardInputError
from .length import AlternatingLengthPenalty
from .linearize import LinearizedReward
from .matching import score_sample
from .phases import TwoPhaseReward
from .record import record_cost, tool_turns

__all__ = ["SWECheckReward"]


class SWECheckReward:
    """See the module docstring. Thread-safe if ``parse``, ``match``, ``scope_ok``, ``cheated`` and ``cost`` are."""

    def __init__(self, *, parse: Callable[[str], Sequence], match: Callable[[Any, Any], bool],
                 linearized: LinearizedReward, scope_ok: Callable[[Any], bool] | None = None,
                 truth_key: str = "bugs", normalize: bool = True,
                 cheated: Callable[[Any], bool] | None = None,
                 length_penalty: AlternatingLengthPenalty | None = None,
                 cost: Callable[[Any], tuple[float, float, float]] | None = None,
                 two_phase: TwoPhaseReward | None = None):
        if not isinstance(linearized, LinearizedReward):
            raise RewardInputError("linearized must be a LinearizedReward (LinearizedReward.at(beta, p, r))")
        self.parse, self.match, self.scope_ok, self.linearized = parse, match, scope_ok, linearized
        self.truth_key, self.normalize, self.cheated = truth_key, normalize, cheated
        self.length_penalty, self.cost, self.two_phase = length_penalty, cost or record_cost, two_phase

    def score(self, sample):
        """The :class:`~syncd.trainer.rewards.SampleScore` of ``sample``."""
        meta = sample.item.meta or {}
        if self.truth_key not in meta:
            raise RewardInputError(f"item {sample.item.index} has no ground truth under meta[{self.truth_key!r}]")
        return score_sample(self.parse(sample.completion), meta[self.truth_key], match=self.match,
                            scope_ok=self.scope_ok)

    def __call__(self, sample) -> float:
        s = self.score(sample)
        r = float(self.linearized(s.precision, s.recall))
        if self.normalize:
            r /= self.linearized.a + self.linearized.b
        cheated = bool(self.cheated(sample)) if self.cheated is not None else False
        tokens, turns, tool_s = self.cost(sample)
        if self.length_penalty is not None:
            r = float(self.length_penalty.reward(sample.step, r, tokens=tokens, turns=turns, tool_time_s=tool_s))
        if self.two_phase is not None:
            r = float(self.two_phase.reward(sample.step, r, completion_tokens=tokens, tool_turns=tool_turns(sample)))
        return 0.0 if cheated else r
