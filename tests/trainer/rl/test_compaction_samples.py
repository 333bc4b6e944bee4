"""``syncd.trainer.rl.compaction`` on hand-made rollouts: the (prompt, completion) cut, the final reward on every
sample, one advantage per sequence, and ``prefix_consistent`` catching a sample that is not what the engine saw."""

from __future__ import annotations

import copy

import pytest
import torch

from syncd.trainer.rl.compaction import prefix_consistent, sequence_rewards, training_samples
from syncd.trainer.rl.rollouts import Rollout, RolloutSequence

# a compacted request: generate [1, 2] -> [3, 4]; summary [1, 2, 3, 4, 9] -> [7]; continuation [1, 8, 7] -> [5]
TURNS = [{"index": 0, "prompt_token_ids": [1, 2], "output_token_ids": [3, 4]},
         {"index": 1, "prompt_token_ids": [1, 2, 3, 4, 9], "output_token_ids": [7]},
         {"index": 2, "prompt_token_ids": [1, 8, 7], "output_token_ids": [5]}]
ROLES = {0: "generate", 1: "summary", 2: "continuation"}


def _seq(tokens, generated, turns) -> RolloutSequence:
    T = len(tokens)
    mask = torch.zeros(T, dtype=torch.bool)
    mask[generated] = True
    z = torch.zeros(T)
    return RolloutSequence(torch.tensor(tokens), mask, z.long(), z, torch.tensor(generated), torch.zeros(0),
                           torch.zeros(1).long(), z.long(), None, 16, 0, turns, [])


def _rollout(reward=0.25) -> Rollout:
    seqs = [_seq([1, 2, 3, 4, 9, 7], [2, 3, 5], [0, 1]), _seq([1, 8, 7, 5], [3], [2])]
    return Rollout("run", "sb", "t", "complete", {"reward": reward},
                   seqs, {i: {"request": 0, "segment": i, "role": r} for i, r in ROLES.items()})


def test_samples_cut_at_the_first_generated_token_and_carry_the_final_reward():
    a, b = training_samples(_rollout())
    assert a.prompt.tolist() == [1, 2] and a.completion.tolist() == [3, 4, 9, 7] and a.roles == ("generate", "summary")
    assert b.prompt.tolist() == [1, 8, 7] and b.completion.tolist() == [5] and b.roles == ("continuation",)
    assert a.reward == b.reward == 0.25
    record = {"turns": TURNS}
    assert prefix_consistent(a, record) and prefix_consistent(b, record)


@pytest.mark.parametrize("tamper", [
    lambda r: r["turns"][1].update(prompt_token_ids=[1, 2, 3, 5, 9]),   # the summary saw another context
    lambda r: r["turns"][0].update(output_token_ids=[3, 6]),            # another sampled id
    lambda r: r["turns"][1].update(output_token_ids=[7, 7]),            # more than the sample holds
    lambda r: r["turns"].pop(1),                                        # a turn the record does not have
])
def test_prefix_consistent_catches_what_the_engine_did_not_see(tamper):
    record = copy.deepcopy({"turns": TURNS})
    tamper(record)
    assert not prefix_consistent(training_samples(_rollout())[0], record)


def test_a_sample_whose_mask_trains_a_prompt_token_is_not_consistent():
    ro = _rollout()
    ro.sequences[0].loss_mask[4] = True  # the summary prompt's token 9 was never sampled
    assert not prefix_consistent(training_samples(ro)[0], {"turns": TURNS})


def test_one_advantage_per_sequence_and_a_missing_reward_is_named():
    ros = [_rollout(), Rollout("run", "sb", "u", "complete", {"reward": 1.0}, [_seq([1, 3], [1], [0])])]
    assert sequence_rewards(ros, [0.5, -0.5]).tolist() == [0.5, 0.5, -0.5]
    with pytest.raises(ValueError, match="2 rollouts but 1"):
        sequence_rewards(ros, [0.5])
    with pytest.raises(KeyError, match="no 'reward'"):
        training_samples(Rollout("run", "sb", "v", "complete", {}, []))
