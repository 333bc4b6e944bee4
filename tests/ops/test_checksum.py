"""The content checksum: same value on every backend, sensitive to every byte and to position."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from syncd.ops import _backend, checksum, checksum_bytes, checksum_many
from syncd.ops import _checksum_math as cm
from syncd.ops._tensors import even_stride
from syncd.ops.reference import checksum as ref
from tests.ops._util import ALL_DTYPES, on, random_bits


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 15, 16, 17, 1000, 65537])
def test_backends_agree_on_every_length(n):
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    want = checksum(data, backend="reference")
    for be in ["cpu", "triton"]:
        assert checksum(on(data, be), backend=be) == want, be
    assert checksum_bytes(data.numpy().tobytes()) == want


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_any_dtype_is_checksummed_by_bytes(dtype):
    t = random_bits((3, 17), dtype, torch.Generator().manual_seed(1))
    assert checksum(t) == checksum_bytes(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    assert checksum(t.t()) == checksum(t.t().contiguous())


def test_large_buffer_uses_threads_and_matches_reference():
    data = np.random.default_rng(0).integers(0, 256, 9 * (1 << 20) + 5, dtype=np.uint8)
    assert checksum(torch.from_numpy(data)) == ref.checksum_bytes(data)


def test_every_single_bit_flip_and_swap_changes_it():
    data = torch.randint(0, 256, (257,), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    base = checksum(data)
    seen = {base}
    for i in range(data.numel()):
        for bit in range(8):
            d = data.clone()
            d[i] ^= 1 << bit
            seen.add(checksum(d))
    assert len(seen) == 1 + 8 * data.numel()
    swapped = data.clone()
    swapped[[0, 9]] = data[[9, 0]]
    assert data[0] == data[9] or checksum(swapped) != base
    assert checksum(torch.zeros(16, dtype=torch.uint8)) != checksum(torch.zeros(17, dtype=torch.uint8))


def test_incremental_update_rule():
    """Changing word i from a to b changes the raw sum by mix(b ^ k_i) - mix(a ^ k_i): the property apply_ uses."""
    data = np.arange(64, dtype=np.uint8)
    raw = cm.raw_sum(data)
    new = data.copy()
    new[17] = 200
    a = int(data[16:24].view("<u8")[0])
    b = int(new[16:24].view("<u8")[0])
    k = (2 + 1) * cm.GOLDEN & cm.MASK64
    delta = (cm.word_mix_int(b ^ k) - cm.word_mix_int(a ^ k)) & cm.MASK64
    assert (raw + delta) & cm.MASK64 == cm.raw_sum(new)


def test_raw_of_inverts_the_finaliser_and_raw_after_adds_the_terms():
    """What delta.changed_words checks a result with: raw back from a checksum, then the changed words' terms."""
    rng = np.random.default_rng(5)
    for n in (0, 1, 7, 8, 9, 4096):
        data = rng.integers(0, 256, n, dtype=np.uint8)
        assert cm.raw_of(ref.checksum_bytes(data), n) == cm.raw_sum(data)
        if n < 16:
            continue
        new = data.copy()
        new[[3, 9, 10, n - 1]] ^= np.uint8(0x5A)
        pad = lambda b: np.concatenate([b, np.zeros(-n % 8, np.uint8)]).view("<u8")  # noqa: E731
        idx = np.array([0, 1, (n - 1) // 8], dtype=np.uint64)
        raw = cm.raw_after(cm.raw_of(ref.checksum_bytes(data), n), idx, pad(data)[idx.astype(int)],
                            pad(new)[idx.astype(int)])
        assert cm.finalize(raw, n) == ref.checksum_bytes(new)


def test_same_bit_flipped_in_two_words_never_cancels():
    """Sums of per-word terms must not cancel for structured damage: the same bit flipped in two words."""
    data = torch.randint(0, 256, (8 * 48,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    base = checksum(data)
    words = data.numel() // 8
    for bit in (0, 7, 31, 32, 62, 63):
        byte, mask = bit // 8, 1 << (bit % 8)
        for i in range(words):
            for j in range(i + 1, words):
                d = data.clone()
                d[8 * i + byte] ^= mask
                d[8 * j + byte] ^= mask
                assert checksum(d) != base, (bit, i, j)


def test_checksum_many_equals_one_by_one():
    g = torch.Generator().manual_seed(9)
    tensors = [random_bits(s, torch.bfloat16, g) for s in [(3,), (0,), (700, 700), (4 << 20,), (17, 5)]]
    want = [checksum(t, backend="reference") for t in tensors]
    assert checksum_many(tensors) == want  # contiguous CPU tensors: one native pool over all their pieces
    tensors.append(tensors[2].t())  # non-contiguous: falls back to one by one
    assert checksum_many(tensors) == want + [checksum(tensors[-1], backend="reference")]


@pytest.mark.parametrize("make", [lambda: torch.arange(32, dtype=torch.float32)[::2],
                                  lambda: torch.arange(48, dtype=torch.float32).reshape(8, 6)[:, :4],
                                  lambda: torch.arange(32, dtype=torch.bfloat16).reshape(4, 8).t()],
                         ids=["step", "columns", "transposed"])
def test_strided_views_checksum_like_their_contiguous_copy(make):
    t = make()
    assert not t.is_contiguous()
    for backend in ("cpu", "reference"):
        assert checksum(t, backend=backend) == checksum(t.contiguous(), backend=backend)


def _halves(rows: int, cols: int) -> torch.Tensor:
    """The high bf16 halves of fp32 weights, as the reference engine serves them (stride 2 elements)."""
    return torch.randn(rows, cols).view(torch.bfloat16)[:, 1::2]


@pytest.mark.parametrize("make, stride", [
    (lambda: torch.arange(32, dtype=torch.float32)[::2], 8),
    (lambda: _halves(4, 6), 4),
    (lambda: torch.zeros(5, 1, 9, dtype=torch.int64)[:, :, ::3], 24),
    (lambda: torch.zeros(5, 1, 7, dtype=torch.int64)[:, :, ::3], None),  # rows of 7, every third: gaps 3, 3, 1
    (lambda: torch.zeros(3, 4)[:, :1], 16),  # a column: one element per row
    (lambda: torch.zeros(6, dtype=torch.int16).expand(2, 6), None),  # rows repeat: not evenly spaced
    (lambda: torch.arange(48, dtype=torch.float32).reshape(8, 6)[:, :4], None),
    (lambda: torch.arange(32, dtype=torch.bfloat16).reshape(4, 8).t(), None),
    (lambda: torch.zeros(4, 4, dtype=torch.complex64).conj(), None),
], ids=["step", "halves", "3d-step", "3d-uneven", "column", "expanded", "columns", "transposed", "conj"])
def test_even_stride_finds_evenly_spaced_elements(make, stride):
    t = make()
    assert even_stride(t) == stride
    if stride is not None:  # the claim: element i lives at data_ptr + i * stride
        flat = t.contiguous().reshape(-1).view(torch.uint8).reshape(t.numel(), t.element_size())
        storage = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
        start = t.data_ptr() - t.untyped_storage().data_ptr()
        at = start + torch.arange(t.numel())[:, None] * stride + torch.arange(t.element_size())
        assert torch.equal(storage[at], flat)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 1000, (1 << 18) + 3])
@pytest.mark.parametrize("step, offset", [(2, 0), (2, 1), (3, 2), (5, 1)])
def test_strided_native_checksum_reads_in_place_what_the_copy_holds(dtype, n, step, offset):
    """The native backend checksums an evenly strided view without copying it (per 512 KiB piece into a
    per-thread buffer; a stride of twice the element size gathers by narrowing): the same value as the
    reference over its contiguous copy, at every length (partial last words, several pieces)."""
    g = torch.Generator().manual_seed(n * 31 + step)
    base = random_bits((n * step + offset + 1,), dtype, g)
    view = base[offset::step][:n]
    assert view.numel() == n and (n < 2 or not view.is_contiguous())
    want = checksum(view.contiguous(), backend="reference")
    assert checksum(view, backend="cpu") == want
    if n:
        native = _backend.native().checksum_strided_ptr
        args = (view.data_ptr(), n, view.element_size(), step * view.element_size())
        assert native(*args, 1) == native(*args, 2) == want


def test_strided_native_checksum_refuses_an_odd_element_size():
    with pytest.raises(ValueError, match="itemsize must be 1, 2, 4 or 8"):
        _backend.native().checksum_strided_ptr(torch.zeros(4).data_ptr(), 2, 3, 6, 1)
