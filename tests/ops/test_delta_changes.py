"""The sparse view of a blob (``delta.changes``/``apply_changes_``) that sliced and fused engine parameters use."""

import pytest
import torch

from syncd.errors import DeltaError
from syncd.ops import delta

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.uint8, torch.int8, torch.int16, torch.int32]


def _pair(dtype, shape=(40, 24), seed=0):
    g = torch.Generator().manual_seed(seed)
    old = (torch.randn(shape, generator=g) * 8).to(dtype)
    new = old.clone()
    mask = torch.rand(shape, generator=g) < 0.2
    new[mask] = (torch.randn(shape, generator=g) * 8).to(dtype)[mask]
    return old, new


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_row_slice_applies_exactly(dtype):
    old, new = _pair(dtype)
    c = delta.changes(delta.encode(old, new))
    assert c.dtype == dtype and c.shape == tuple(old.shape)
    assert torch.equal(c.positions, torch.nonzero((old.view(torch.uint8) != new.view(torch.uint8))
                                                  .view(old.numel(), -1).any(1)).flatten())
    lo, hi = 10 * 24, 30 * 24
    local = old[10:30].clone()
    keep = (c.positions >= lo) & (c.positions < hi)
    delta.apply_changes_(local.view(-1), c.positions[keep] - lo, c.values[keep])
    assert torch.equal(local.view(torch.uint8), new[10:30].contiguous().view(torch.uint8))


def test_checksums_and_validation():
    old, new = _pair(torch.bfloat16)
    blob = delta.encode(old, new)
    c = delta.changes(blob)
    info = delta.inspect(blob)
    assert (c.base_checksum, c.new_checksum) == (info["base_checksum"], info["new_checksum"])
    bad = bytearray(blob)
    bad[-3] ^= 0x40
    with pytest.raises(DeltaError):
        delta.changes(bytes(bad))
    flat = old.clone().view(-1)
    before = flat.clone()
    with pytest.raises(DeltaError, match="outside"):
        delta.apply_changes_(flat, c.positions + 10_000, c.values)
    with pytest.raises(DeltaError, match="positions but"):
        delta.apply_changes_(flat, c.positions[:-1], c.values)
    assert torch.equal(flat.view(torch.int16), before.view(torch.int16))
