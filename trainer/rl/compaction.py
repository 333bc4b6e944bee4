"""Training samples from self-compacted trajectories (the proxy side is ``syncd.engine.proxy.compaction``).

A compacted request is recorded as segments, one turn each: *generate* (context ``C``, output ``O``),
*summary* (prompt ``C + O + summary prompt``, the model's summary ``S``) and *continuation* (prompt
``head + resume + S + continue``, output ``O'``), and so on. :func:`syncd.trainer.rl.rollouts.read_rollouts` already
joins each turn with its replay records (versions, log-probs, kept sets, routes) and merges a turn into the
sequence before it when its prompt extends that sequence: a summary extends its generate (or continuation)
segment, a continuation starts a new sequence. So a compacted trajectory reads back as one sequence per
context window, ``[C, O, summary prompt, S]``, ``[C', O', summary prompt, S']``, ..., ``[C'', O'']``: each one
exactly the ids one engine context held, with no token detokenised and tokenised again -- the continuation's
copy of ``S`` is a prompt there, and the summary is trained where it was sampled.

:func:`training_samples` turns a rollout into :class:`TrainingSample` s: the sequence, its (prompt, completion)
split at the first generated token, the roles of the turns it holds, and the trajectory's final reward, which
every sample gets -- the summary tokens are credited with the outcome of the whole trajectory, as the seed
trains its self-summaries. :func:`prefix_consistent` checks a sample against the trajectory record: every turn
merged into it has its prompt as a prefix of the sample and its sampled ids, in order, right after it, at the
sample's generated positions. :func:`sequence_rewards` repeats each trajectory's reward per sequence (what the
loss needs: one advantage per sequence).

Pure; thread-safe.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from syncd.trainer.rl.rollouts import Rollout, RolloutSequence

__all__ = ["TrainingSample", "training_samples", "prefix_consistent", "sequence_rewards"]


@dataclass(frozen=True)
class TrainingSample:
    """One training sample: ``sequence`` (tokens, loss mask, versions, log-probs, kept sets, routes), ``prompt``
    and ``completion`` (the tokens before and from its first generated token), ``roles`` of its turns
    (``"turn"`` for a turn that is no compaction segment) and ``reward``, the trajectory's."""

    sequence: RolloutSequence
    prompt: torch.Tensor
    completion: torch.Tensor
    roles: tuple[str, ...]
    reward: float


def _roles(rollout: Rollout, seq: RolloutSequence) -> tuple[str, ...]:
    return tuple((rollout.compaction.get(i) or {}).get("role", "turn") for i in seq.turns)


def training_samples(rollout: Rollout, *, reward_key: str = "reward") -> list[TrainingSample]:
    """The rollout's sequences as samples, each with the trajectory's final reward (``metadata[reward_key]``;
    KeyError when the trajectory was finished without one)."""
    if reward_key not in rollout.metadata:
        raise KeyError(f"trajectory {rollout.sandbox_id}/{rollout.trajectory_id} has no {reward_key!r} in its "
                       "metadata: finish it with its reward")
    reward = float(rollout.metadata[reward_key])
    out = []
    for seq in rollout.sequences:
        gen = torch.nonzero(seq.loss_mask)
        cut = int(gen[0]) if gen.numel() else len(seq)
        out.append(TrainingSample(seq, seq.tokens[:cut], seq.tokens[cut:], _roles(rollout, seq), reward))
    return out


def prefix_consistent(sample: TrainingSample, record: dict) -> bool:
    """Whether every turn of ``record`` merged into ``sample`` saw a prefix of it as its prompt and sampled exactly
    the ids at the sample's generated positions after it; and the sample generated nothing else."""
    tokens = sample.sequence.tokens.tolist()
    mask = sample.sequence.loss_mask.tolist()
    expected = [False] * len(tokens)
    turns = {t["index"]: t for t in record["turns"]}
    for i in sample.sequence.turns:
        t = turns.get(i)
        if t is None:
            return False
        p, o = list(t["prompt_token_ids"]), list(t["output_token_ids"])
        if tokens[:len(p)] != p or tokens[len(p):len(p) + len(o)] != o:
            return False
        for q in range(len(p), len(p) + len(o)):
            expected[q] = True
    end = max((len(turns[i]["prompt_token_ids"]) + len(turns[i]["output_token_ids"]) for i in sample.sequence.turns),
              default=0)
    prompt_ok = sample.prompt.tolist() + sample.completion.tolist() == tokens
    return prompt_ok and end == len(tokens) and expected == mask


def sequence_rewards(rollouts: list[Rollout], rewards) -> torch.Tensor:
    """``rewards`` (one per rollout) repeated once per sequence of each rollout, float32."""
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    if rewards.numel() != len(rollouts):
        raise ValueError(f"{len(rollouts)} rollouts but {rewards.numel()} rewards")
    return rewards.repeat_interleave(torch.tensor([len(r.sequences) for r in rollouts], dtype=torch.int64))
