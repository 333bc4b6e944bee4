"""The NVFP4 reference (the spec) against independent statements of it: brute-force rounding, vLLM's own
Python recipe, the cuBLAS scale layout formula."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from syncd.ops import _nvfp4_format as layout
from syncd.ops import nvfp4
from syncd.ops.reference import nvfp4 as ref
from tests.ops.test_nvfp4_helpers import E2M1_GRID, KINDS, e2m1_brute, e4m3_brute, e4m3_grid, near_boundaries, sample


def test_e2m1_rounding_is_nearest_even_saturating_and_keeps_the_sign():
    rng = np.random.default_rng(0)
    mids = (E2M1_GRID[1:] + E2M1_GRID[:-1]) / 2
    mags = near_boundaries(np.concatenate([rng.uniform(0, 8, 20000), [6.5, 7.0, 1e30, 3.4e38]]),
                           np.concatenate([mids, E2M1_GRID]))
    s = np.concatenate([mags, -mags, [0.0, -0.0, 1e-45, -1e-45]]).astype(np.float32)
    got = ref.e2m1_codes(torch.from_numpy(s)).numpy()
    np.testing.assert_array_equal(got, e2m1_brute(s))
    assert ref.e2m1_codes(torch.tensor([-0.0, -0.2, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -7.0])).tolist() == \
        [8, 8, 0, 2, 2, 4, 4, 6, 6, 15]


def test_e4m3_rounding_is_nearest_even_saturating_with_subnormals():
    grid = e4m3_grid()
    mids = (grid[1:] + grid[:-1]) / 2
    rng = np.random.default_rng(1)
    v = near_boundaries(np.concatenate([rng.uniform(0, 500, 20000), 2.0 ** rng.uniform(-14, -5, 5000),
                                        [0.0, 2.0 ** -10, 448.0, 463.9, 464.0, 470.0, 1e30, np.inf]]),
                        np.concatenate([mids, grid]))
    v = v[v >= 0]
    got = ref.e4m3_codes(torch.from_numpy(v)).numpy()
    np.testing.assert_array_equal(got, e4m3_brute(v))
    assert ref.e4m3_codes(torch.tensor([2.0 ** -10, 2.0 ** -10 * 1.0001, 500.0, float("inf")])).tolist() == \
        [0, 1, 126, 126]


def _cast_to_fp4(x):
    # vLLM's cast_to_fp4 (tests / nvfp4_emulation_utils), verbatim in behaviour: the recipe's E2M1 rounding
    sign = torch.sign(x)
    x = torch.abs(x)
    x[(x >= 0.0) & (x <= 0.25)] = 0.0
    x[(x > 0.25) & (x < 0.75)] = 0.5
    x[(x >= 0.75) & (x <= 1.25)] = 1.0
    x[(x > 1.25) & (x < 1.75)] = 1.5
    x[(x >= 1.75) & (x <= 2.5)] = 2.0
    x[(x > 2.5) & (x < 3.5)] = 3.0
    x[(x >= 3.5) & (x <= 5.0)] = 4.0
    x[x > 5.0] = 6.0
    return x * sign


def _reciprocal(x):
    return torch.where(x == 0, torch.tensor(0.0, dtype=x.dtype), 1.0 / x)


def vllm_ref_nvfp4_quant(x, global_scale):
    """vLLM's ref_nvfp4_quant (model_executor/layers/quantization/utils/nvfp4_emulation_utils.py): the
    FlashInfer recipe in Python. Returns (E2M1 values as float32, block scales as float32)."""
    m, n = x.shape
    x = torch.reshape(x, (m, n // 16, 16))
    vec_max = torch.max(torch.abs(x), dim=-1, keepdim=True)[0].to(torch.float32)
    scale = global_scale * (vec_max * (1.0 / 6.0))
    scale = torch.clamp(scale, max=448, min=-448)
    scale = scale.to(torch.float8_e4m3fn).to(torch.float32)
    output_scale = _reciprocal(scale * _reciprocal(global_scale))
    scaled_x = x.to(torch.float32) * output_scale
    clipped_x = torch.clamp(scaled_x, -6.0, 6.0).reshape(m, n)
    return _cast_to_fp4(clipped_x), scale.squeeze(-1)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_codes_and_scales_equal_vllms_python_recipe(kind, backend):
    g = torch.Generator().manual_seed(KINDS.index(kind))
    x = sample(kind, (37, 256), g)
    q = nvfp4.quantize(x, backend=backend)
    gs = torch.reciprocal(q.per_tensor_scale.reshape(1))  # the recipe's encode-convention global scale
    want_values, want_scales = vllm_ref_nvfp4_quant(x, gs)
    codes = ref.unpack_codes(q.qdata).long()
    got_values = torch.tensor(ref.E2M1_VALUES)[codes]
    assert torch.equal(got_values, want_values)  # (vLLM's sign() maps -0.0 and tiny negatives to +0.0)
    assert torch.equal(q.scales.float(), want_scales)


def test_per_tensor_scale_is_amax_over_2688_clamped():
    x = torch.tensor([[0.5, -3.0] + [0.0] * 14], dtype=torch.bfloat16)
    assert nvfp4.per_tensor_scale(x).item() == np.float32(3.0) / np.float32(2688.0)
    assert nvfp4.per_tensor_scale(torch.zeros(2, 16)).item() == 2.0 ** -100
    assert nvfp4.per_tensor_scale(torch.full((16,), 3e38)).item() == 2.0 ** 100
    assert nvfp4.per_tensor_scale(torch.zeros(0, 16)).item() == 2.0 ** -100


def test_dequantize_is_code_times_scale_times_pts():
    q = nvfp4.quantize(torch.tensor([[6.0, -1.5, 0.25, 0.3] + [0.0] * 12]), per_tensor_scale=2.0 ** -8)
    # sf = 256 (6 * fp32(1/6) rounds to 1), output scale 1: codes are the values themselves
    assert q.scales.float().tolist() == [[256.0]]
    assert ref.unpack_codes(q.qdata)[0, :4].tolist() == [7, 11, 0, 1]
    assert q.dequantize(torch.float32)[0, :4].tolist() == [6.0, -1.5, 0.0, 0.5]


def test_swizzle_follows_the_cublas_128x4_layout():
    g = torch.Generator().manual_seed(3)
    for m, s in [(1, 1), (130, 7), (256, 8), (5, 4)]:
        lin = torch.randint(0, 127, (m, s), dtype=torch.uint8, generator=g)
        sw = layout.swizzle(lin)
        mp, sp = layout.swizzled_shape(m, s)
        assert sw.shape == (mp, sp)
        flat = sw.reshape(-1)
        for r in range(m):
            for c in range(s):
                tile = (r // 128) * (sp // 4) + c // 4
                off = tile * 512 + (r % 32) * 16 + ((r // 32) % 4) * 4 + c % 4
                assert flat[off] == lin[r, c]
        assert int(flat.sum()) == int(lin.sum())  # the padding is zero
        assert torch.equal(layout.unswizzle(sw, m, s), lin)


def test_swizzle_keeps_leading_dimensions_per_matrix():
    lin = torch.arange(2 * 3 * 200 * 5, dtype=torch.int64).reshape(2, 3, 200, 5) % 127
    sw = layout.swizzle(lin.to(torch.uint8))
    assert sw.shape == (2, 3, 256, 8)
    assert torch.equal(sw[1, 2], layout.swizzle(lin[1, 2].to(torch.uint8)))
