"""Rewards for RL post-training: the SWE-check bug-detection reward and the SWE-1.7 length/cheating rules.

Pure Python and numpy; every function is exact (no sampling) and validates its inputs, raising
:class:`RewardInputError` (a ``ValueError``) with a message naming the bad argument.

* :mod:`~syncd.trainer.rewards.fbeta`: :func:`fbeta`, its gradient, and F_β from pooled TP/FP/FN counts.
* :mod:`~syncd.trainer.rewards.matching`: per-sample scoring, :func:`sample_pr` → (P(τ), R(τ)), with a pluggable
  scope judge and matcher and one-to-one *maximum* bipartite matching.
* :mod:`~syncd.trainer.rewards.population`: P_pop, R_pop, F_β(P_pop, R_pop), and the pooled alternative.
* :mod:`~syncd.trainer.rewards.linearize`: :func:`linearize` → (a, 1), the sample reward a·P(τ) + R(τ) whose
  mean climbs F_β(P_pop, R_pop) to first order, with recalibration.
* :mod:`~syncd.trainer.rewards.latency`: latency estimate and :func:`latency_penalty` from users' switch-away
  times; :mod:`~syncd.trainer.rewards.phases`: the capability → product two-phase reward.
* :mod:`~syncd.trainer.rewards.length`: the alternating length penalty and :func:`zero_if_cheating`.
* :mod:`~syncd.trainer.rewards.cheating`: :class:`CheatingCheck`, pluggable detectors of cheating attempts over a
  trajectory record's tool calls (hidden tests and grader files, git history, network access from a restricted
  sandbox, writes to the grading path); a hit zeroes the reward (:func:`zero_if_cheating`).
* :mod:`~syncd.trainer.rewards.exploits`: detectors of the verifier QA's exploits (test tampering, hard-coded
  outputs) and of sandbox escapes; :func:`agent_detectors`, every detector the agent tasks run.
* :mod:`~syncd.trainer.rewards.swe`: :class:`SWECheckReward`, all of the above behind the thin trainer's reward
  interface (``syncd.trainer.rl.tasks.RewardFn``: a ``Sample`` in, a float out).
* :mod:`~syncd.trainer.rewards.record`: rewards on the trajectory record -- :func:`record_cost` (tokens, turns,
  tool time), :class:`RecordReward` (length penalty, latency phase, cheating around any base reward) and
  :func:`parse_options` (``--task NAME:OPTIONS``).
"""

from __future__ import annotations

from ._validate import RewardInputError
from .cheating import CheatingCheck, CheatReport, GitHistory, GradingWrite, HiddenFiles, NetworkAccess
from .exploits import HardcodedOutputs, SandboxEscape, TestTampering, agent_detectors
from .fbeta import fbeta, fbeta_from_counts, fbeta_grad, pr_from_counts
from .latency import LatencyModel, SwitchAwayCDF, latency_penalty
from .length import AlternatingLengthPenalty, CostWeights, LengthPhase, zero_if_cheating
from .linearize import LinearizedReward, linearize
from .matching import SampleScore, max_bipartite_matching, sample_pr, score_sample
from .phases import Phase, TwoPhaseReward
from .population import PopulationMetrics, population_metrics
from .record import RecordReward, parse_options, record_cost
from .swe import SWECheckReward

__all__ = [
    "AlternatingLengthPenalty",
    "CheatReport",
    "CheatingCheck",
    "CostWeights",
    "GitHistory",
    "GradingWrite",
    "HardcodedOutputs",
    "HiddenFiles",
    "LatencyModel",
    "LengthPhase",
    "LinearizedReward",
    "NetworkAccess",
    "Phase",
    "PopulationMetrics",
    "RecordReward",
    "RewardInputError",
    "SWECheckReward",
    "SampleScore",
    "SandboxEscape",
    "SwitchAwayCDF",
    "TestTampering",
    "TwoPhaseReward",
    "agent_detectors",
    "fbeta",
    "fbeta_from_counts",
    "fbeta_grad",
    "latency_penalty",
    "linearize",
    "parse_options",
    "max_bipartite_matching",
    "population_metrics",
    "pr_from_counts",
    "record_cost",
    "sample_pr",
    "score_sample",
    "zero_if_cheating",
]
