"""The sparse view of a blob (``delta.changes``/``apply_changes_``) that sliced and fused engine parameters use."""

import numpy as np
import pytest
import torch

from syncd.errors import DeltaError
from syncd.ops import _backend, delta

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


def _as_int(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


@pytest.fixture(params=["cpu", "reference"])
def host(request, monkeypatch):
    """Run the codec natively (``cpu``) or, with the native backend reported unavailable, on the NumPy
    reference (``changed_words``' host half included)."""
    if request.param == "reference":
        real = _backend.available
        monkeypatch.setattr(_backend, "available",
                            lambda b, d="cpu": "forced off by the test" if b == "cpu" else real(b, d))
    return request.param


@pytest.mark.parametrize("dtype", DTYPES + [torch.float64, torch.int64], ids=str)
@pytest.mark.parametrize("shape", [(40, 24), (3,), (7, 9)], ids=str)
@pytest.mark.parametrize("version", [1, 2])
def test_changed_words_are_the_old_and_new_bits_at_the_changes(dtype, shape, version, host):
    g = torch.Generator().manual_seed(len(shape) * 100 + shape[0])
    old = (torch.randn(shape, generator=g) * 8).to(dtype)
    other = (torch.randn(shape, generator=g) * 8).to(dtype)
    new = torch.where(torch.rand(shape, generator=g) < 0.3, other.double(), old.double()).to(dtype)
    blob = delta.encode(old, new, version=version)
    c = delta.changes(blob, base=old)
    before, after = delta.changed_words(old, c)
    assert before.dtype == after.dtype == _as_int(old).dtype
    assert torch.equal(before, _as_int(old)[c.positions]) and torch.equal(after, _as_int(new)[c.positions])


def test_changed_words_of_a_big_format2_tensor_and_a_strided_base(host):
    g = torch.Generator().manual_seed(3)
    old = (torch.randn(300, 70, generator=g) * 0.02).to(torch.bfloat16)
    new = torch.where(torch.rand(300, 70, generator=g) < 0.1, (old.float() * 1.01).to(torch.bfloat16), old)
    c = delta.changes(delta.encode(old, new, version=2, block_log2=12), base=old)
    assert delta.needs_base(delta.encode(old, new, version=2, block_log2=12))
    before, after = delta.changed_words(old, c)
    assert torch.equal(after, _as_int(new)[c.positions]) and torch.equal(before, _as_int(old)[c.positions])
    t_old, t_new = old.t().contiguous().t(), new.t().contiguous().t()  # same values, column-major storage
    c2 = delta.changes(delta.encode(old, new), base=t_old)
    assert torch.equal(delta.changed_words(t_old, c2)[1], _as_int(t_new.contiguous())[c2.positions])


def test_changed_words_refuses_what_decode_would(host):
    old, new = _pair(torch.bfloat16)
    c = delta.changes(delta.encode(old, new))
    other = old.clone()
    other.view(-1)[int(c.positions[0])] = new.view(-1)[int(c.positions[0])]
    with pytest.raises(DeltaError, match="wrong base"):
        delta.changed_words(other, c)
    with pytest.raises(DeltaError, match="base is"):
        delta.changed_words(old[:10], c)
    # a change list that does not take the base to the encoder's result: the result checksum says so
    tampered = delta.Changes(c.dtype, c.shape, c.positions, c.values ^ 2, c.base_checksum, c.new_checksum)
    with pytest.raises(DeltaError, match="result checksum mismatch"):
        delta.changed_words(old, tampered)
    swapped = c.positions.clone()
    swapped[[0, 1]] = swapped[[1, 0]]
    with pytest.raises(DeltaError, match="must ascend"):
        delta.changed_words(old, delta.Changes(c.dtype, c.shape, swapped, c.values, c.base_checksum, c.new_checksum))
    outside = c.positions.clone()
    outside[-1] = old.numel()
    with pytest.raises(DeltaError, match="outside the 960-element tensor"):
        delta.changed_words(old, delta.Changes(c.dtype, c.shape, outside, c.values, c.base_checksum, c.new_checksum))
    with pytest.raises(DeltaError, match="positions but"):
        delta.changed_words(old, delta.Changes(c.dtype, c.shape, c.positions, c.values[1:], c.base_checksum,
                                               c.new_checksum))
    wide = c.values.clone()
    wide[3] = 1 << 16
    with pytest.raises(DeltaError, match="too wide"):
        delta.changed_words(old, delta.Changes(c.dtype, c.shape, c.positions, wide, c.base_checksum, c.new_checksum))


@pytest.mark.parametrize("itemsize, dtype", [(1, torch.uint8), (2, torch.int16), (4, torch.int32), (8, torch.int64)])
@pytest.mark.parametrize("numel, step", [(1, 1), (7, 1), (1000, 1), (1001, 2), (300_001, 2), (999, 3)])
def test_native_word_gather_reads_a_view_in_place(itemsize, dtype, numel, step):
    """``words_at_ptr`` (what ``changed_words`` reads the changed words of a CPU base with): the words of the
    view's contiguous copy, zero past its last element, on one thread or several; a word past the end is an
    error, not a read outside the tensor."""
    g = torch.Generator().manual_seed(numel + step)
    base = torch.randint(-(1 << 30), 1 << 30, (numel * step + 1,), generator=g, dtype=torch.int64).to(dtype)
    view = base[1::step][:numel]
    per = 8 // itemsize
    nwords = (numel + per - 1) // per
    padded = torch.zeros(nwords * per, dtype=dtype)
    padded[:numel] = view
    image = padded.view(torch.int64).numpy().view(np.uint64)
    words = np.unique(np.random.default_rng(numel).integers(0, nwords, size=min(nwords, 5000))).astype(np.uint64)
    native = _backend.native().words_at_ptr
    for threads in (1, 2):
        got = native(view.data_ptr(), numel, itemsize, step * itemsize, words, threads)
        assert np.array_equal(got, image[words.astype(np.int64)])
    with pytest.raises(ValueError, match="past the"):
        native(view.data_ptr(), numel, itemsize, step * itemsize, np.array([nwords], dtype=np.uint64), 2)
