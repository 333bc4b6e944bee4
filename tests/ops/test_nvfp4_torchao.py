"""Our NVFP4 quantizer against an independent one: torchao's (``nvfp4_quantize``, plain PyTorch on the CPU).

torchao computes the same quantities in another order (``x * ((1/pts) / sf)`` where the recipe has
``x * 1/(sf * (1/(1/pts)))``, ``amax / 6`` where it has ``amax * fp32(1/6)``), so the two may round a value
that lies within a few float32 ulps of a rounding boundary to different sides. The tests check that every
code and scale agrees except exactly such boundary cases, which must be rare, and that torchao clamps block
scales below 2**-6 (the E4M3 subnormals, our documented edge case) where the recipe does not. Dequantization
is the same product in the same order and must agree bit for bit.
"""

from __future__ import annotations

import importlib
import logging
import warnings

import pytest
import torch

from syncd.ops import nvfp4
from syncd.ops.reference import nvfp4 as ref
from tests.ops.test_nvfp4_helpers import KINDS, sample
from tests.ops._util import same_bits

with warnings.catch_warnings():  # torchao is a declared test dependency: a broken install fails here, never skips
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)  # torchao logs that its CUDA extensions do not load on a CPU-only torch
    try:
        ao = importlib.import_module("torchao.prototype.mx_formats.nvfp4_tensor")
    finally:
        logging.disable(logging.NOTSET)

E2M1_BOUNDARIES = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float64)
E4M3_MIDPOINTS = torch.from_numpy(
    (lambda g: (g[1:] + g[:-1]) / 2)(torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).double().numpy()))
TIE_TOLERANCE = 2.0 ** -21  # relative: a few float32 ulps, the spread of two orders of float32 operations


def rel_dist(values: torch.Tensor, boundaries: torch.Tensor) -> torch.Tensor:
    return ((values.abs()[:, None] - boundaries[None, :]).abs() / boundaries[None, :]).min(dim=1).values


def compare(x: torch.Tensor, pts: torch.Tensor) -> dict:
    """Quantize ``x`` [M, K] with both; return the counts of agreeing and boundary-explained elements, after
    asserting that every disagreement is explained."""
    ours = nvfp4.quantize(x, per_tensor_scale=pts, backend="cpu")
    ao_scales, ao_qdata = ao.nvfp4_quantize(x, per_tensor_scale=pts)
    m, k = x.shape
    s_ours, s_ao = ours.scales.view(torch.uint8), ao_scales.view(torch.uint8)
    clamped = s_ours < 8  # torchao: max(scale, 2**-6); the recipe keeps E4M3 subnormals and zero
    assert (s_ao[clamped] == 8).all()
    exact_scale = x.double().abs().reshape(m, k // 16, 16).amax(-1) / (6 * pts.double())
    scale_diff = (s_ours != s_ao) & ~clamped
    if scale_diff.any():
        assert (rel_dist(exact_scale[scale_diff], E4M3_MIDPOINTS) < TIE_TOLERANCE).all()
    same_scale = ~(clamped | scale_diff)
    c_ours = ref.unpack_codes(ours.qdata).reshape(m, k // 16, 16)
    c_ao = ref.unpack_codes(ao_qdata).reshape(m, k // 16, 16)
    code_diff = (c_ours != c_ao) & same_scale[..., None]
    exact = x.double().reshape(m, k // 16, 16) / (ours.scales.double() * pts.double())[..., None]
    if code_diff.any():
        assert (rel_dist(exact[code_diff], E2M1_BOUNDARIES) < TIE_TOLERANCE).all()
        assert ((c_ours ^ c_ao)[code_diff] & 8 == 0).all()  # never the sign: only the side of the boundary
        assert ((c_ours.short() - c_ao.short()).abs()[code_diff] == 1).all()  # neighbouring values
    return {"elements": int(same_scale.sum()) * 16, "code_ties": int(code_diff.sum()),
            "scale_ties": int(scale_diff.sum()), "clamped_blocks": int(clamped.sum()), "blocks": m * k // 16}


SHAPES = [(1, 16), (3, 32), (17, 48), (64, 96), (40, 512)]


@pytest.mark.parametrize("kind", KINDS)
def test_codes_and_scales_equal_torchaos_except_float32_ties(kind):
    g = torch.Generator().manual_seed(2024 + KINDS.index(kind))
    total = {"elements": 0, "code_ties": 0, "scale_ties": 0, "clamped_blocks": 0, "blocks": 0}
    for shape in SHAPES:
        for dtype in (torch.bfloat16, torch.float32):
            x = sample(kind, shape, g, dtype)
            if not torch.isfinite(x).all():
                continue
            pts = nvfp4.per_tensor_scale(x)
            ao_pts = ao.per_tensor_amax_to_scale(x.abs().amax())
            assert same_bits(pts, torch.clamp(ao_pts, ref.PTS_MIN, ref.PTS_MAX))  # ours is clamped
            for scale in (pts, pts * 0.61, pts * 3.0):  # computed, calibrated below and above the amax
                scale = torch.clamp(scale, ref.PTS_MIN, ref.PTS_MAX)
                for k, v in compare(x, scale).items():
                    total[k] += v
    assert total["elements"] > 10_000
    if kind != "ints":  # small integers are exact ties by construction: there only "explained" counts
        # exact ties of the scaled value with a boundary happen for low-precision inputs; each order of
        # float32 operations breaks them its own way
        assert total["code_ties"] <= 2e-3 * total["elements"], total  # small tensors: a looser bound
        assert total["scale_ties"] <= 1e-3 * total["blocks"], total


def test_ordinary_weights_agree_except_rare_ties():
    """Weight-like bf16 matrices at the computed per-tensor scale: ties are well under one code in a thousand.
    (They are real ties of the exact quantities: x / (sf * amax / 2688) often equals a boundary exactly, e.g.
    x = amax / 8 in the block of the amax, where sf = 448; the rounding of pts then decides the side.)"""
    g = torch.Generator().manual_seed(1)
    ties = n = 0
    for _ in range(4):
        x = (torch.randn(512, 1024, generator=g) * 0.02).to(torch.bfloat16)
        r = compare(x, nvfp4.per_tensor_scale(x))
        assert r["clamped_blocks"] == 0 and r["scale_ties"] == 0
        ties, n = ties + r["code_ties"], n + r["elements"]
    assert ties <= 1e-3 * n


@pytest.mark.parametrize("kind", ["normal", "lognormal", "outlier_rows"])
def test_dequantize_equals_torchaos(kind):
    g = torch.Generator().manual_seed(KINDS.index(kind))
    x = sample(kind, (96, 128), g)
    q = nvfp4.quantize(x, backend="cpu")
    t = ao.NVFP4Tensor(q.qdata, q.scales, 16, torch.bfloat16, per_tensor_scale=q.per_tensor_scale)
    for dtype in (torch.bfloat16, torch.float32):
        assert same_bits(nvfp4.dequantize(q, dtype, backend="cpu"), t.dequantize(dtype))


def test_swizzled_scales_equal_torchaos_blocked_layout():
    from torchao.prototype.mx_formats.utils import to_blocked

    g = torch.Generator().manual_seed(5)
    for m, k in [(1, 16), (130, 112), (256, 512)]:
        q = nvfp4.quantize(sample("normal", (m, k), g))
        blocked = to_blocked(q.scales.view(torch.uint8))
        assert torch.equal(q.to_swizzled().scales.view(torch.uint8).reshape(-1), blocked.reshape(-1))
