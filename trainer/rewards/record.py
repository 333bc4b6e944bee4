"""Rewards on the trajectory record: the cost of a trajectory, the SWE-1.7 rules around any base reward, and the
options that configure them from the command line.

A sample (``syncd.trainer.rl.tasks.Sample``) carries the trajectory record as the proxy holds it when the reward is
computed (``sample.record``: every turn, and in a version 2 record every tool call with its output and wall
time). :func:`record_cost` reads ``(generated tokens, turns, tool seconds)`` from it (without a record:
``(completion_tokens, 1, 0.0)``). :class:`RecordReward` applies to a base reward, in this order:

1. the alternating length penalty (:class:`~syncd.trainer.rewards.AlternatingLengthPenalty`) over the weighted
   cost of tokens, turns and tool time, at the sample's trainer step;
2. the latency phase (:class:`~syncd.trainer.rewards.TwoPhaseReward`): from its start step, minus the weighted
   latency penalty of the trajectory's tokens and tool calls;
3. cheating (:class:`~syncd.trainer.rewards.CheatingCheck` over the record): 0 for any attempt, successful or not.

It returns ``(reward, info)``; the rollout workers record ``info`` with the trajectory (``metadata
["reward_info"]``): the base reward, the cost, the phases, and the detectors that fired (``cheating``).

:func:`parse_options` reads the options of ``--task NAME:OPTIONS`` (comma-separated): ``cheating`` /
``nocheating``, ``length=UNCONSTRAINED/BUDGET_STEPS/BUDGET[/PER_TOKEN/PER_TURN/PER_TOOL_SECOND]``,
``latency=START/WEIGHT[/S_PER_TOKEN/S_PER_TURN]`` (with the switch-away histogram :data:`SWITCH_AWAY`, an
assumed one: 5-80 s, most users gone by 40 s), and task options (``turns=N``, ``quarantine=PATH``) passed through.
Thread-safe where the base reward and the detectors are.
"""

from __future__ import annotations

import math

from ._validate import RewardInputError
from .cheating import CheatingCheck
from .latency import LatencyModel, SwitchAwayCDF
from .length import AlternatingLengthPenalty, CostWeights
from .phases import TwoPhaseReward

__all__ = ["record_cost", "tool_turns", "RecordReward", "parse_options", "SWITCH_AWAY"]

#: the switch-away histogram the latency phase uses from the command line: (bucket edges in s, counts)
SWITCH_AWAY = ((0.0, 5.0, 10.0, 20.0, 40.0, 80.0), (5.0, 15.0, 30.0, 30.0, 20.0))


def _record(sample):
    rec = getattr(sample, "record", None)
    return rec if isinstance(rec, dict) else None


def record_cost(sample) -> tuple[float, float, float]:
    """``(generated tokens, turns, tool seconds)`` of the sample's trajectory (module docstring)."""
    rec = _record(sample)
    if rec is None:
        return float(getattr(sample, "completion_tokens", 0) or 0), 1.0, 0.0
    turns = [t for t in rec.get("turns") or [] if isinstance(t, dict)]
    tokens = sum(len(t.get("output_token_ids") or []) for t in turns)
    tool_s = sum(float(c.get("wall_s") or 0.0) for c in rec.get("tool_calls") or [] if isinstance(c, dict))
    return float(tokens), float(max(len(turns), 1)), tool_s


def tool_turns(sample) -> int:
    """Turns of the trajectory that called a tool."""
    rec = _record(sample)
    return len({c.get("turn") for c in (rec or {}).get("tool_calls") or [] if isinstance(c, dict)})


class RecordReward:
    """``base`` with the SWE-1.7 rules on the record (module docstring). ``base(sample)`` returns a float (or
    ``(float, info)``, whose info is kept under ``"base_info"``)."""

    needs_record = True

    def __init__(self, base, *, cheating: CheatingCheck | None = None,
                 length_penalty: AlternatingLengthPenalty | None = None, two_phase: TwoPhaseReward | None = None):
        self.base, self.cheating, self.length_penalty, self.two_phase = base, cheating, length_penalty, two_phase

    def __call__(self, sample) -> tuple[float, dict]:
        got = self.base(sample)
        base, base_info = (got if isinstance(got, tuple) else (got, None))
        r = float(base)
        if not math.isfinite(r):
            raise RewardInputError(f"the base reward is {r}")
        tokens, turns, tool_s = record_cost(sample)
        info = {"base": r, "cost": {"tokens": tokens, "turns": turns, "tool_s": round(tool_s, 6)}}
        if base_info:
            info["base_info"] = base_info
        if self.length_penalty is not None:
            info["length_phase"] = self.length_penalty.phase(sample.step).value
            r = float(self.length_penalty.reward(sample.step, max(r, 0.0), tokens=tokens, turns=turns,
                                                 tool_time_s=tool_s))
        if self.two_phase is not None:
            info["latency_phase"] = self.two_phase.phase(sample.step).value
            r = float(self.two_phase.reward(sample.step, r, completion_tokens=tokens, tool_turns=tool_turns(sample)))
        if self.cheating is not None:
            rec = _record(sample)
            if rec is None:
                raise RewardInputError("cheating detection needs the trajectory record (sample.record)")
            report = self.cheating.check(rec)
            info["cheating"] = sorted(report.detectors)
            if report.flagged:
                info["cheating_evidence"] = [f"{h.detector}: {h.evidence}"[:300] for h in report.hits[:8]]
                r = 0.0
        return r, info


def _floats(text: str, name: str, n_min: int, n_max: int) -> list[float]:
    try:
        vals = [float(x) for x in text.split("/")]
    except ValueError:
        raise ValueError(f"{name}={text}: numbers separated by '/' expected") from None
    if not n_min <= len(vals) <= n_max or not all(math.isfinite(v) for v in vals):
        raise ValueError(f"{name}={text}: {n_min} to {n_max} finite numbers expected")
    return vals


def parse_options(options: str, *, cheating_default: bool) -> dict:
    """The reward stack and task options of ``--task NAME:OPTIONS`` (module docstring): ``{"cheating": bool,
    "length_penalty": ... | None, "two_phase": ... | None, "task": {other key: value}}``. ValueError naming
    the option."""
    out = {"cheating": cheating_default, "length_penalty": None, "two_phase": None, "task": {}}
    for opt in filter(None, (o.strip() for o in (options or "").split(","))):
        key, _, value = opt.partition("=")
        if key in ("cheating", "nocheating") and not value:
            out["cheating"] = key == "cheating"
        elif key == "length":
            u, b, budget, *w = _floats(value, key, 3, 6)
            weights = CostWeights(*(w + [1.0, 0.0, 0.0][len(w):]))
            out["length_penalty"] = AlternatingLengthPenalty.periodic(int(u), int(b), budget=budget, weights=weights)
        elif key == "latency":
            start, weight, *lat = _floats(value, key, 2, 4)
            model = LatencyModel(*(lat + [0.01, 2.0][len(lat):]))
            out["two_phase"] = TwoPhaseReward(int(start), weight, model, SwitchAwayCDF(*SWITCH_AWAY))
        elif value:
            out["task"][key] = value
        else:
            raise ValueError(f"unknown task option {opt!r} (cheating, nocheating, length=..., latency=..., "
                             "KEY=VALUE)")
    return out
