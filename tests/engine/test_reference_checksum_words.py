"""The reference engine's checksum, which the demos' "bit-exact" and the daemon's verification rest on, covers the
whole fp32 words the CPU engine computes with, not only their bf16 halves: a weight whose low half is set (its
value differs from the published bf16 one) no longer matches the manifest's checksum."""

from __future__ import annotations

import pytest
import torch

from syncd.engine.reference import ReferenceEngine
from syncd.engine.reference.model import load_folder_weights
from syncd.ops import checksum


@pytest.mark.parametrize("tp_size", [1, 2])
def test_a_set_low_half_of_an_fp32_weight_breaks_the_match(dense_dir, tp_size):
    engine = ReferenceEngine.from_pretrained(dense_dir, max_batch=1, tp_size=tp_size)
    try:
        words = engine.runner.fp32_words
        assert words and set(words) == set(engine.runner.local_tensors)  # float32 compute on CPU, bf16 weights
        before = engine.checksum()
        if tp_size == 1:
            assert before == {k: checksum(v) for k, v in load_folder_weights(dense_dir).items()}
        name = sorted(words)[0]
        low = words[name].reshape(-1).view(torch.int16)[0::2]
        low[0] = 1  # the bf16 word (the high half) is unchanged: only the fp32 value moved
        after = engine.checksum()
        assert after[name] != before[name]
        assert {k: v for k, v in after.items() if k != name} == {k: v for k, v in before.items() if k != name}
        assert engine.checksum([name]) == {name: after[name]}
        low[0] = 0
        assert engine.checksum() == before
    finally:
        engine.close()
