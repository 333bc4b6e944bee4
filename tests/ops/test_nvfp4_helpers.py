"""Shared by the NVFP4 tests (imported from here): inputs from many distributions, and an independent,
brute-force statement of E2M1/E4M3 rounding (checked on known values below)."""

from __future__ import annotations

import math

import numpy as np
import torch

E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def sample(kind: str, shape, gen: torch.Generator, dtype=torch.bfloat16) -> torch.Tensor:
    """A tensor of ``shape`` drawn from a named distribution (weights-like and adversarial ones)."""
    n = math.prod(shape)
    if kind == "normal":
        x = torch.randn(n, generator=gen) * 0.02
    elif kind == "uniform":
        x = torch.rand(n, generator=gen) * 2 - 1
    elif kind == "laplace":
        u = torch.rand(n, generator=gen) - 0.5
        x = -torch.sign(u) * torch.log1p(-2 * u.abs())
    elif kind == "lognormal":  # heavy tails: a few huge values, many small blocks relative to the amax
        x = torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 1.5)
    elif kind == "outlier_rows":  # rows of very different scale, as in real weight matrices
        rows = shape[0] if len(shape) > 1 else 1
        x = (torch.randn(rows, n // rows, generator=gen) * torch.exp(2 * torch.randn(rows, 1, generator=gen))).reshape(-1)
    elif kind == "sparse":
        x = torch.randn(n, generator=gen) * (torch.rand(n, generator=gen) < 0.1)
    elif kind == "tiny":
        x = torch.randn(n, generator=gen) * 1e-30
    elif kind == "huge":
        x = torch.randn(n, generator=gen) * 1e30
    elif kind == "ints":  # exact small integers: many exact ties between E2M1 values
        x = torch.randint(-12, 13, (n,), generator=gen).float()
    else:
        raise ValueError(kind)
    return x.reshape(shape).to(dtype)


KINDS = ["normal", "uniform", "laplace", "lognormal", "outlier_rows", "sparse", "tiny", "huge", "ints"]


def e2m1_brute(s: np.ndarray) -> np.ndarray:
    """Codes by brute force: the nearest grid magnitude, ties to the even code index, saturating; sign bit of
    the input kept (so -0.0 and negatives that round to 0 get code 8)."""
    a = np.minimum(np.abs(s.astype(np.float64)), 6.0)
    d = np.abs(a[:, None] - E2M1_GRID[None, :])
    best = d.min(axis=1, keepdims=True)
    cand = d == best
    idx = np.where(cand.sum(axis=1) > 1, np.argmax(cand & (np.arange(8) % 2 == 0)[None, :], axis=1),
                   np.argmax(cand, axis=1))
    return (idx | (np.signbit(s).astype(np.int64) << 3)).astype(np.uint8)


def e4m3_grid() -> np.ndarray:
    """The 127 non-negative finite float8_e4m3fn values, by code."""
    return torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).double().numpy()


def e4m3_brute(v: np.ndarray) -> np.ndarray:
    """Codes of non-negative values by brute force: nearest, ties to the even code, saturating at 448."""
    grid = e4m3_grid()
    a = np.minimum(v.astype(np.float64), 448.0)
    d = np.abs(a[:, None] - grid[None, :])
    best = d.min(axis=1, keepdims=True)
    cand = d == best
    idx = np.where(cand.sum(axis=1) > 1, np.argmax(cand & (np.arange(127) % 2 == 0)[None, :], axis=1),
                   np.argmax(cand, axis=1))
    return idx.astype(np.uint8)


def near_boundaries(values: np.ndarray, boundaries: np.ndarray) -> np.ndarray:
    """Around every boundary: the boundary and its float32 neighbours up to 2 ulps either side."""
    b = boundaries.astype(np.float32)
    out = [b]
    up, down = b.copy(), b.copy()
    for _ in range(2):
        up = np.nextafter(up, np.float32(np.inf))
        down = np.nextafter(down, np.float32(0))
        out += [up, down]
    return np.concatenate(out + [values.astype(np.float32)])


def test_brute_force_rounding_on_known_values():
    s = np.array([0.25, 0.26, 0.75, 1.25, 1.3, 1.75, 2.5, 2.6, 3.5, 5.0, 5.1, 7.0, -0.0, -0.1, -6.0], np.float32)
    assert e2m1_brute(s).tolist() == [0, 1, 2, 2, 3, 4, 4, 5, 6, 6, 7, 7, 8, 8, 15]
    v = np.array([0.0, 2.0 ** -10, 2.0 ** -9, 1.0625, 1.1875, 448.0, 460.0, 1e9])
    # 2**-10 is halfway between 0 and the smallest subnormal 2**-9 (code 1): ties to even 0; 1.0625 halfway
    # between 1 (code 56) and 1.125 (57): to 56; 1.1875 halfway between 57 and 58: to 58; then saturation
    assert e4m3_brute(v).tolist() == [0, 0, 1, 56, 58, 126, 126, 126]
    assert e4m3_grid()[56] == 1.0 and e4m3_grid()[126] == 448.0
    assert set(KINDS) == {"normal", "uniform", "laplace", "lognormal", "outlier_rows", "sparse", "tiny", "huge", "ints"}
    g = torch.Generator().manual_seed(0)
    for kind in KINDS:
        assert sample(kind, (4, 32), g).shape == (4, 32)
