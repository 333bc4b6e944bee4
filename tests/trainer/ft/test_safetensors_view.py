"""syncd.trainer.ft.safetensors_view: zero-copy tensors over a safetensors file in memory, checked against the
safetensors library (the reference) on valid files, and differentially fuzzed on hostile ones: whatever it accepts, the
library accepts with the same tensors; anything else is a ValueError naming what is wrong, never another exception."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from syncd.trainer.ft.ckpt_format import write_safetensors
from syncd.trainer.ft.safetensors_view import view_safetensors


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(3, 5, generator=g), "b16": torch.randn(7, generator=g).to(torch.bfloat16),
            "h": torch.randn(2, 3, generator=g).half(), "i": torch.arange(-4, 5, dtype=torch.int64),
            "mask": torch.tensor([True, False, True]), "u8": torch.arange(5, dtype=torch.uint8),
            "scalar": torch.tensor(3.5, dtype=torch.float64), "empty": torch.zeros(0, 4),
            "f8": torch.randn(4, generator=g).to(torch.float8_e4m3fn)}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)  # bit for bit: NaN payloads and float8 too


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(_bits(a[k]), _bits(b[k])) for k in a)


@pytest.mark.parametrize("writer", ["library", "ours"])
def test_views_equal_the_librarys_tensors_and_share_the_buffer(writer):
    t = _tensors()
    if writer == "library":
        raw = st_save(t, metadata={"format": "pt"})
    else:
        import io

        f = io.BytesIO()
        write_safetensors(f, t, {"format": "pt"})
        raw = f.getvalue()
    buf = bytearray(raw)
    got = view_safetensors(buf, where="test")
    assert _same(got, st_load(raw)) and _same(got, t)
    lo = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
    assert all(lo <= v.data_ptr() < lo + len(buf) for k, v in got.items() if v.numel())  # views, not copies
    got["w"][0, 0] = 42.0  # writable, and it is the buffer's memory
    assert view_safetensors(buf, where="test")["w"][0, 0] == 42.0


def _file(header: dict, data: bytes) -> bytearray:
    raw = json.dumps(header).encode()
    return bytearray(struct.pack("<Q", len(raw)) + raw + data)


def test_a_misaligned_tensor_is_copied_with_the_right_values():
    f32 = torch.tensor([1.5, -2.25], dtype=torch.float32)
    buf = _file({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
                 "b": {"dtype": "F32", "shape": [2], "data_offsets": [1, 9]}},
                b"\x07" + f32.numpy().tobytes())
    got = view_safetensors(buf, where="test")
    assert got["a"].tolist() == [7] and torch.equal(got["b"], f32)


@pytest.mark.parametrize("header, data, says", [
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4, "shape [2] of F32 is 8 bytes"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 8, "cover 4 of the 8"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 8]}}, b"\0" * 4, "outside the 4 data bytes"),
    ({"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
      "b": {"dtype": "U8", "shape": [2], "data_offsets": [1, 3]}}, b"\0" * 3, "overlap or leave a gap"),
    ({"a": {"dtype": "Q4", "shape": [1], "data_offsets": [0, 1]}}, b"\0", "unknown dtype"),
    ({"a": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 1]}}, b"\0", "shape must be"),
    ({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1], "x": 1}}, b"\0", "exactly dtype"),
    ({"__metadata__": {"k": 1}}, b"", "__metadata__"),
    ([1, 2], b"", "not a JSON object"),
])
def test_malformed_files_are_refused_naming_the_problem(header, data, says):
    with pytest.raises(ValueError, match="f.safetensors") as e:
        view_safetensors(_file(header, data), where="f.safetensors")
    assert says in str(e.value)


def test_header_length_and_buffer_kind_are_checked():
    with pytest.raises(ValueError, match="shorter than"):
        view_safetensors(bytearray(b"\1\0"), where="x")
    with pytest.raises(ValueError, match="header of 4096 bytes in a file of 12"):
        view_safetensors(bytearray(struct.pack("<Q", 4096) + b"{}  "), where="x")
    with pytest.raises(TypeError, match="writable"):
        view_safetensors(st_save(_tensors()), where="x")


VALID = st_save({"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "m": torch.tensor([True, False]),
                 "h": torch.ones(3, dtype=torch.float16)})


def _differential(raw: bytes) -> None:
    try:
        ours = view_safetensors(bytearray(raw), where="fuzz")
    except ValueError:
        return
    assert _same(ours, st_load(raw))  # accepted: the library must accept it too, with the same tensors


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)), max_size=6),
       st.integers(0, len(VALID)))
def test_fuzz_byte_flips_and_truncations(flips, cut):
    raw = bytearray(VALID)
    for at, b in flips:
        raw[at] = b
    _differential(bytes(raw[:cut]))


_ENTRY = st.fixed_dictionaries({
    "dtype": st.sampled_from(["F32", "U8", "BOOL", "F16", "I64", "X"]),
    "shape": st.lists(st.integers(-1, 4), max_size=3),
    "data_offsets": st.lists(st.integers(-1, 40), min_size=2, max_size=2)})


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["a", "b", "c"]), _ENTRY, max_size=3), st.binary(max_size=48))
def test_fuzz_random_headers(header, data):
    _differential(bytes(_file(header, data)))
