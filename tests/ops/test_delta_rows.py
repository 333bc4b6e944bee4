"""Format 2's mode 3 (positions by row flags, ``syncd/ops/reference/rows.py``): encoders write it for sparse blocks,
every backend the same bytes and every backend reads it, at about mode 2's size; its probability rules; and the
blobs written before it (modes 1 and 2, committed vectors) still decode. The SIMD levels' agreement on it is
``test_delta_v2.py``'s probe; its hostile blobs are in ``test_delta_hostile.py``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from syncd.ops import _format as fmt
from syncd.ops import delta
from tests.ops._util import on, perturb, random_bits, same_bits
from tests.ops.test_delta_v2 import CPU_BACKENDS, block_modes, forced_mode_blob, weight_pair


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64], ids=str)
def test_sparse_blocks_are_coded_by_row_flags_on_every_backend(dtype):
    """At about 2% changed (at most 1/32 of a block: ROW_FLAGS_DENSITY) encoders write mode 3, every backend the
    same bytes (triton: the GPU route, classes handed over as nibbles), and every backend reads it; denser blocks
    stay in mode 2."""
    g = torch.Generator().manual_seed(11)
    old = random_bits((3 * 16384 + 501,), dtype, g)
    new = perturb(old, 0.02, g, max_step=40)
    new[: 16384] = perturb(old[: 16384], 0.1, g, max_step=40)  # the first block dense
    blobs = {b: delta.encode(on(old, b), on(new, b), backend=b, block_log2=14, version=2) for b in CPU_BACKENDS}
    assert blobs["cpu"] == blobs["reference"] == blobs["triton"]
    assert block_modes(blobs["cpu"]) == [fmt.MODE_CONTEXT_BY_DEPTH, fmt.MODE_ROW_FLAGS, fmt.MODE_ROW_FLAGS,
                                         fmt.MODE_ORDER0]
    for b in CPU_BACKENDS:
        t = on(old.clone(), b)
        delta.apply_(t, blobs["cpu"], backend=b)
        assert same_bits(t, new), b
    c1, c2 = delta.changes(delta.encode(old, new)), delta.changes(blobs["cpu"], base=old)
    assert torch.equal(c1.positions, c2.positions) and torch.equal(c1.values, c2.values)


def test_row_flags_cost_about_what_mode_2_does():
    """Mode 3 codes the same decisions as mode 2 with a row flag first: within 1.5% of mode 2's bytes on
    weight-like deltas at about 1% changed (the benchmark measures it on real AdamW deltas)."""
    old, new = weight_pair(1 << 20, 3e-7, seed=2)
    density = (old.view(torch.int16) != new.view(torch.int16)).float().mean().item()
    assert 0.005 < density < 1 / fmt.ROW_FLAGS_DENSITY
    blob3, blob2 = delta.encode(old, new, version=2), forced_mode_blob(old, new, fmt.MODE_CONTEXT_BY_DEPTH, 20)
    assert set(block_modes(blob3)) == {fmt.MODE_ROW_FLAGS} and set(block_modes(blob2)) == {fmt.MODE_CONTEXT_BY_DEPTH}
    assert len(blob3) < 1.015 * len(blob2)
    assert same_bits(delta.decode(old, blob3), new) and same_bits(delta.decode(old, blob2), new)


@pytest.mark.parametrize("name", ["bf16", "fp32"])
def test_blobs_written_before_mode_3_still_decode(name):
    """Committed blobs of the encoders before mode 3 (modes 0 and 2, and the reference's mode 1) decode bit for bit
    on every backend; the reference told to write mode 2 still writes exactly those bytes."""
    from tests.ops import _vectors

    old, new, dtype, block_log2 = _vectors.weight_like(name)
    for mode in (fmt.MODE_CONTEXT, fmt.MODE_CONTEXT_BY_DEPTH):
        blob = _vectors.blob(name, mode)
        assert set(block_modes(blob)) - {fmt.MODE_ORDER0} == {mode}
        for be in CPU_BACKENDS:
            t = on(old.clone(), be)
            delta.apply_(t, blob, backend=be)
            assert same_bits(t, new), (mode, be)
        assert forced_mode_blob(old, new, mode, block_log2) == blob
    assert fmt.MODE_ROW_FLAGS in block_modes(delta.encode(old, new, version=2, block_log2=block_log2))


def test_chain_probabilities_follow_the_suffix_sums():
    """Mode 3's chain probability of a lane: about p * 2**16 / (p + the lanes above), from the sum's leading 4
    bits (so at most 1/8 high); between p and 65535; p itself once the sum reaches 2**16; 0 for a lane not
    coded."""
    from syncd.ops.reference import rows

    p = np.array([655] * 16)
    q = rows.chain_probabilities(p)
    exact = 655 * 65536 / (655 * np.arange(16, 0, -1))
    assert q[-1] == 65535 and np.all(q[:-1] >= exact[:-1]) and np.all(q[:-1] <= 1.125 * exact[:-1] + 1)
    assert np.all(np.diff(q) >= 0)
    p = np.array([0, 100, 0, 30000, 40000, 5] + [0] * 9 + [1])
    assert rows.chain_probabilities(p).tolist() == [0, 100, 0, 30000, 65535, 54612] + [0] * 9 + [65535]
    rng = np.random.default_rng(0)
    for _ in range(200):
        p = rng.integers(0, 65536, 16) * (rng.random(16) < 0.7) >> rng.integers(0, 14)
        q = rows.chain_probabilities(p)
        s = np.cumsum(p[::-1])[::-1]
        assert np.all((q >= p) & (q <= 65535)) and np.all(q[p == 0] == 0) and np.all(q[s >= 65536] == p[s >= 65536])


def test_row_contexts_and_flag_probabilities():
    from syncd.ops.reference import rows

    classes = np.zeros(40, np.uint8)
    classes[[3, 17, 39]] = [5, 2, 9]
    assert rows.row_contexts(classes).tolist() == [5, 2, 9]  # the largest class of each row, a partial last one
    changed = np.zeros(40, bool)
    changed[[16, 33]] = True
    flags = rows.changed_rows(changed)
    assert flags.tolist() == [False, True, True]
    pa = rows.flag_probabilities(np.array([5, 5, 2, 5]), np.array([True, False, False, True]))
    assert pa[5] == 43691 and pa[2] == 0 and pa.sum() == 43691  # 2 of 3 rows; a context without changed rows: 0
