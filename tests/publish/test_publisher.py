"""syncd.trainer.WeightPublisher with a real tiny Qwen2, real AdamW steps, and a real local store."""

from __future__ import annotations

import json
import re
import threading

import pytest
import torch

import syncd
from syncd import manifest as mf
from syncd.errors import PublishError, StoreError, VersionConflict
from syncd.store import Store
from syncd.versions import list_versions, read_manifest
from tests.store._models import assert_same, bf16, tiny_qwen2, train_steps
from syncd.trainer import WeightPublisher
from syncd.publish.shard_writer import delta_formats

KEY = "publisher-test-key-0123456789"


class GatedStore(Store):
    """A local store whose shard/manifest writes wait for ``gate`` (to hold an upload in flight), and that
    can fail the writes of chosen versions."""

    def __init__(self, root):
        super().__init__(root)
        self.gate = threading.Event()
        self.gate.set()
        self.fail_versions: set[int] = set()
        self.lose_manifest_replies = 0  # manifest writes that land but whose reply is lost

    def put(self, key, data, *, create=False):
        if key.endswith("manifest.json") and self.lose_manifest_replies:
            self.lose_manifest_replies -= 1
            super().put(key, data, create=create)
            raise StoreError(f"injected: connection lost after writing {key}")
        if "/versions/" in key:
            self.gate.wait()
            v = mf.parse_version_dir(key.split("/versions/")[1].split("/")[0])
            if v in self.fail_versions:
                self.fail_versions.discard(v)
                raise StoreError(f"injected failure writing {key}")
        return super().put(key, data, create=create)


def versions(store, run="r"):
    return [(i.version, i.manifest.kind, i.manifest.step) for i in list_versions(store, run, signing_key=KEY)
            if i.manifest]


def test_real_training_every_step_materializes_bit_exact(tmp_path):
    model = tiny_qwen2()
    store = Store(tmp_path)
    expected = []
    with WeightPublisher(store, "r", signing_key=KEY, full_every=3, shard_bytes=32 << 10) as pub:
        def step(s, m):
            assert pub.publish(m, s)
            expected.append(bf16(m.state_dict()))

        step(0, model)
        train_steps(model, 6, callback=lambda s, m: step(s + 1, m))
    assert versions(store) == [(0, "full", 0), (1, "delta", 1), (2, "delta", 2), (3, "full", 3),
                               (4, "delta", 4), (5, "delta", 5), (6, "full", 6)]
    for v, want in enumerate(expected):
        assert_same(syncd.materialize(store, "r", v, signing_key=KEY), want)
    stats = list(pub.history)
    assert [s.kind for s in stats] == ["full", "delta", "delta", "full", "delta", "delta", "full"]
    full_bytes = stats[0].full_bytes
    assert all(s.uploaded_bytes < full_bytes / 3 for s in stats if s.kind == "delta")
    for v in (3, 4):  # a full and a delta version: shards hold <= shard_bytes, or one bigger tensor
        m = read_manifest(store, "r", v, signing_key=KEY)
        per_shard = [[t for t in m.tensors if t.shard == i] for i in range(len(m.shards))]
        assert len(per_shard) > (4 if v == 3 else 0)
        assert all(len(ts) == 1 or sum(t.length for t in ts) <= 32 << 10 for ts in per_shard)
    hint = json.loads(store.get(mf.latest_hint_key("r")))
    assert hint["version"] == 6 and hint["step"] == 6


def test_format2_deltas_with_sliced_tensors_in_format1_materialize_bit_exact(tmp_path):
    from syncd.engines.update import tensors_of
    from syncd.ops import delta
    from syncd.versions import fetch_shards

    model = tiny_qwen2()
    store = Store(tmp_path)
    expected = []
    sliced = r".*\.(o|down)_proj\.weight"
    with WeightPublisher(store, "r", signing_key=KEY, full_every=4, delta_format=2, sliced_tensors=sliced) as pub:
        def step(s, m):
            assert pub.publish(m, s)
            expected.append(bf16(m.state_dict()))

        step(0, model)
        train_steps(model, 3, callback=lambda s, m: step(s + 1, m))
    for v, want in enumerate(expected):
        assert_same(syncd.materialize(store, "r", v, signing_key=KEY), want)
    m = read_manifest(store, "r", 2, signing_key=KEY)
    assert m.kind == "delta"
    blobs = tensors_of(m, fetch_shards(store, "r", m))
    formats = {name: delta.inspect(blob)["format_version"] for name, blob in blobs.items()}
    context = {name for name, blob in blobs.items() if delta.needs_base(blob)}
    is_sliced = {n: bool(re.fullmatch(sliced, n)) for n in formats}
    assert sum(is_sliced.values()) == 4 and all(formats[n] == (1 if is_sliced[n] else 2) for n in formats)
    # the format-2 deltas of the matrices are context-coded: an engine needs their whole old tensor to decode
    assert "model.layers.0.mlp.gate_proj.weight" in context and not context & {n for n in formats if is_sliced[n]}


def test_delta_formats_are_checked_and_chosen_by_name(tmp_path):
    assert delta_formats()("a") == 1 and delta_formats(2)("a") == 2
    pick = delta_formats(2, sliced_tensors=r"x\..*")
    assert (pick("x.w"), pick("y.x.w")) == (1, 2)
    assert delta_formats(1, sliced_tensors=r"x\..*")("x.w") == 1
    for bad in (0, 3, True, "2"):
        with pytest.raises(ValueError, match="delta_format must be 1 or 2"):
            delta_formats(bad)
    with pytest.raises(ValueError, match="sliced_tensors '\\(' is not a regular expression"):
        WeightPublisher(tmp_path, "r", delta_format=2, sliced_tensors="(")
    assert list(tmp_path.iterdir()) == []  # refused before anything was opened


def test_every_k_publishes_every_kth_step(tmp_path):
    states = [bf16(tiny_qwen2().state_dict())] * 10
    with WeightPublisher(tmp_path, "r", every_k=3, signing_key=KEY) as pub:
        taken = [pub.publish(states[s], s) for s in range(10)]
    assert taken == [s % 3 == 0 for s in range(10)]
    assert [step for _, _, step in versions(Store(tmp_path))] == [0, 3, 6, 9]


def test_publish_returns_while_upload_is_in_flight_and_snapshot_is_isolated(tmp_path):
    model = tiny_qwen2()
    store = GatedStore(tmp_path)
    pub = WeightPublisher(store, "r", signing_key=KEY)
    store.gate.clear()
    snapshot = bf16(model.state_dict())
    assert pub.publish(model, 0)  # returns although nothing can be written yet
    train_steps(model, 2)  # the optimizer changes the weights in place right away
    with pytest.raises(TimeoutError):
        pub.flush(timeout=0.05)
    assert syncd.latest_version(store, "r", signing_key=KEY) is None  # nothing visible mid-upload
    store.gate.set()
    pub.flush()
    pub.close()
    assert_same(syncd.materialize(store, "r", 0, signing_key=KEY), snapshot)


def test_on_busy_skip_drops_a_step_instead_of_stalling(tmp_path):
    state = bf16(tiny_qwen2().state_dict())
    store = GatedStore(tmp_path)
    pub = WeightPublisher(store, "r", signing_key=KEY, on_busy="skip")
    store.gate.clear()
    assert pub.publish(state, 0)
    assert not pub.publish(state, 1)  # previous still uploading
    store.gate.set()
    pub.flush()
    assert pub.publish(state, 2)
    pub.close()
    assert [step for _, _, step in versions(store)] == [0, 2]


def test_memory_is_two_reused_snapshot_sets(tmp_path):
    model = tiny_qwen2()
    ptrs = set()
    with WeightPublisher(tmp_path, "r", signing_key=KEY) as pub:
        for s in range(5):
            pub.publish(model, s)
            pub.flush()
            ptrs.add(next(iter(pub._prev.values())).data_ptr())
            assert pub._spare is None or set(pub._spare) == set(pub._prev)
            train_steps(model, 1)
    assert len(ptrs) == 2


def test_background_failure_is_raised_on_next_call_and_publishing_carries_on(tmp_path):
    model = tiny_qwen2()
    store = GatedStore(tmp_path)
    expected = {}
    pub = WeightPublisher(store, "r", signing_key=KEY, full_every=100)
    for s in range(2):
        pub.publish(model, s)
        expected[s] = bf16(model.state_dict())
        train_steps(model, 1)
    pub.flush()
    store.fail_versions.add(2)
    pub.publish(model, 2)  # its upload fails in the background
    train_steps(model, 1)
    with pytest.raises(PublishError, match="injected failure") as err:
        pub.publish(model, 3)
    assert isinstance(err.value.__cause__, StoreError)
    assert pub.publish(model, 4)  # the error was reported once; the next version goes out
    expected[4] = bf16(model.state_dict())
    pub.close()
    assert versions(store) == [(0, "full", 0), (1, "delta", 1), (2, "delta", 4)]
    for v, step in ((0, 0), (1, 1), (2, 4)):
        assert_same(syncd.materialize(store, "r", v, signing_key=KEY), expected[step])
    assert not any(i.manifest is None for i in list_versions(store, "r", signing_key=KEY))  # shards removed


def test_a_manifest_write_whose_reply_was_lost_is_confirmed_not_repeated(tmp_path):
    model = tiny_qwen2()
    store = GatedStore(tmp_path)
    store.lose_manifest_replies = 1
    with WeightPublisher(store, "r", signing_key=KEY) as pub:
        pub.publish(model, 0)
        pub.flush()  # no error: the manifest is in the store with exactly our bytes
        train_steps(model, 1)
        pub.publish(model, 1)
    assert versions(store) == [(0, "full", 0), (1, "delta", 1)]
    assert_same(syncd.materialize(store, "r", 1, signing_key=KEY), bf16(model.state_dict()))


def test_second_publisher_on_the_same_run_is_a_fatal_conflict(tmp_path):
    state = bf16(tiny_qwen2().state_dict())
    a = WeightPublisher(tmp_path, "r", signing_key=KEY)
    a.publish(state, 0)
    a.flush()
    b = WeightPublisher(tmp_path, "r", signing_key=KEY)
    b.publish(state, 0)
    b.close()  # takes version 1
    a.publish(state, 1)  # also wants version 1
    with pytest.raises(PublishError) as err:
        a.flush()
    assert isinstance(err.value.__cause__, VersionConflict)
    with pytest.raises(PublishError):
        a.publish(state, 2)  # final: this publisher stops
    with pytest.raises(PublishError):
        a.close()
    m = read_manifest(tmp_path, "r", 1, signing_key=KEY)
    assert m.session == b.session


def test_a_restarted_publisher_continues_with_a_full_version(tmp_path):
    model = tiny_qwen2()
    states = []
    for run in range(2):
        with WeightPublisher(tmp_path, "r", signing_key=KEY) as pub:
            for _ in range(2):
                pub.publish(model, len(states))
                states.append(bf16(model.state_dict()))
                train_steps(model, 1)
    assert versions(Store(tmp_path)) == [(0, "full", 0), (1, "delta", 1), (2, "full", 2), (3, "delta", 3)]
    assert_same(syncd.materialize(tmp_path, "r", 3, signing_key=KEY), states[3])


def test_dtypes_and_tied_weights(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(cfg)
    state = dict(model.state_dict())
    state["counter"] = torch.arange(5, dtype=torch.int64)
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    with WeightPublisher(tmp_path, "bf", signing_key=KEY) as pub:
        pub.publish(state, 0)
    with WeightPublisher(tmp_path, "fp", signing_key=KEY, dtype=None) as pub:
        pub.publish(state, 0)
    got = syncd.materialize(tmp_path, "bf", signing_key=KEY)
    assert got["lm_head.weight"].dtype == torch.bfloat16 and got["counter"].dtype == torch.int64
    assert torch.equal(got["counter"], state["counter"])
    full = syncd.materialize(tmp_path, "fp", signing_key=KEY)
    assert_same(full, {k: v.detach() for k, v in state.items()})
    fresh = Qwen2ForCausalLM(cfg)
    fresh.load_state_dict({k: v for k, v in full.items() if k != "counter"}, strict=True)
    assert torch.equal(fresh.lm_head.weight, model.lm_head.weight)


def test_bad_calls_are_clear_errors(tmp_path):
    state = {"w": torch.zeros(3)}
    with pytest.raises(ValueError, match="every_k"):
        WeightPublisher(tmp_path, "r", every_k=0)
    with pytest.raises(ValueError, match="invalid run id"):
        WeightPublisher(tmp_path, "../r")
    pub = WeightPublisher(tmp_path, "r", signing_key=KEY)
    with pytest.raises(TypeError, match="str -> torch.Tensor"):
        pub.publish({"w": [1, 2]}, 0)
    with pytest.raises(TypeError, match="complex64 cannot be published"):
        pub.publish({"w": torch.zeros(2, dtype=torch.complex64)}, 0)
    pub.publish(state, 5)
    with pytest.raises(ValueError, match="step 5 does not increase"):
        pub.publish(state, 5)
    pub.close()
    pub.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        pub.publish(state, 6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_weights_are_snapshotted_and_encoded_on_the_gpu(tmp_path):
    model = tiny_qwen2().cuda()
    expected = []
    with WeightPublisher(tmp_path, "r", signing_key=KEY, full_every=4) as pub:
        for s in range(4):
            pub.publish(model, s)
            expected.append({k: v.cpu() for k, v in bf16(model.state_dict()).items()})
            train_steps(model, 1)
        pub.flush()
        assert next(iter(pub._prev.values())).is_cuda
    for v in range(4):
        assert_same(syncd.materialize(tmp_path, "r", v, signing_key=KEY), expected[v])
    on_gpu = syncd.materialize(tmp_path, "r", 3, signing_key=KEY, device="cuda")
    assert all(t.is_cuda for t in on_gpu.values())
    assert_same({k: v.cpu() for k, v in on_gpu.items()}, expected[3])


@pytest.mark.parametrize("poison", ["nan", "inf", "-inf", "bf16 overflow"])
def test_non_finite_weights_are_never_published_and_the_last_good_version_stays_newest(tmp_path, poison):
    """A diverged trainer's weights (a real publish of a tiny Qwen2 with one poisoned value) are refused by name,
    nothing of them reaches the store (no shard, no manifest, the hint unchanged), so an engine following the store
    keeps the last good version; the next finite weights go out as a delta on it. Before, they were published. A
    float32 value past bfloat16's range is refused too: the version would hold the inf the cast makes of it."""
    from syncd.publish.finite import NonFiniteWeights
    from syncd.versions import latest_version

    model = tiny_qwen2()
    store = Store(tmp_path)
    pub = WeightPublisher(store, "r", signing_key=KEY, full_every=100)
    pub.publish(model, 0)
    good = bf16(model.state_dict())
    pub.flush()
    keys = sorted(o.key for o in store.list("runs/r/"))
    name = "model.layers.1.mlp.down_proj.weight"
    with torch.no_grad():
        saved = model.state_dict()[name][3, 5].item()
        model.state_dict()[name][3, 5] = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf"),
                                          "bf16 overflow": 3.4e38}[poison]
    assert pub.publish(model, 1)  # the snapshot is taken; the check runs before anything is encoded
    with pytest.raises(PublishError, match=rf"non-finite weights in the weights of step 1: tensor '{name}' "
                                           r"\(bfloat16\[\d+, \d+\]\) has 1 of \d+ values NaN or \+-inf") as err:
        pub.flush()
    assert isinstance(err.value.__cause__, NonFiniteWeights)
    assert "the engines keep serving the last good version" in str(err.value)
    assert sorted(o.key for o in store.list("runs/r/")) == keys  # nothing written, the hint included
    assert latest_version(store, "r", signing_key=KEY) == 0
    assert json.loads(store.get(mf.latest_hint_key("r")))["version"] == 0
    with torch.no_grad():
        model.state_dict()[name][3, 5] = saved
    train_steps(model, 1)
    assert pub.publish(model, 2)
    pub.close()
    assert versions(store) == [(0, "full", 0), (1, "delta", 2)]
    assert_same(syncd.materialize(store, "r", 0, signing_key=KEY), good)
    assert_same(syncd.materialize(store, "r", 1, signing_key=KEY), bf16(model.state_dict()))


def test_check_finite_counts_every_slice_and_names_the_first(monkeypatch):
    """Tensors are checked in slices (a small mask); the count and the first index span the slices; integer and
    boolean tensors are always finite; float8 kinds without an isfinite kernel are checked too."""
    from syncd.publish import finite
    from syncd.publish.finite import NonFiniteWeights, check_finite

    monkeypatch.setattr(finite, "SLICE_ELEMS", 7)
    w = torch.zeros(5, 6)
    w[2, 4], w[4, 1] = float("inf"), float("nan")
    ok = {"i": torch.arange(10), "b": torch.ones(3, dtype=torch.bool), "e": torch.zeros(0)}
    check_finite(ok)
    with pytest.raises(NonFiniteWeights, match=r"tensor 'w' \(float32\[5, 6\]\) has 2 of 30 values NaN or \+-inf "
                                               r"\(the first at flat index 16: inf\), and 1 more tensor"):
        check_finite({**ok, "w": w, "v": torch.tensor([float("nan")])})
    f8 = torch.zeros(4).to(torch.float8_e4m3fn)
    check_finite({"f8": f8})
    with pytest.raises(NonFiniteWeights, match="'f8'"):
        check_finite({"f8": torch.tensor([0.0, float("nan")]).to(torch.float8_e4m3fn)})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.float8_e5m2])
@pytest.mark.parametrize("poison", [float("nan"), float("inf"), float("-inf")])
def test_check_finite_finds_one_bad_value_anywhere_in_any_float_dtype(monkeypatch, dtype, poison):
    """The check reduces each slice to its minimum and maximum: one NaN or infinity at a slice's first, last or a
    middle element (slices of 37, so past the SIMD widths), or in a one-element slice, is found in every float
    dtype; the largest finite values of each dtype, and a float64 value past float32's range, are finite."""
    from syncd.publish import finite
    from syncd.publish.finite import NonFiniteWeights, check_finite

    monkeypatch.setattr(finite, "SLICE_ELEMS", 37)
    info = torch.finfo(dtype)
    edges = torch.tensor([info.max, info.min, info.tiny, -info.tiny, 0.0], dtype=torch.float64).to(dtype)
    check_finite({"edges": edges})
    if dtype == torch.float64:
        check_finite({"wide": torch.tensor([1e300, -1e300], dtype=torch.float64)})
    n = 3 * 37 + 1  # the last slice holds one element
    for at in (0, 36, 37, 55, 73, n - 1):
        w = torch.linspace(-1, 1, n, dtype=torch.float64).to(dtype)
        w[at] = poison
        with pytest.raises(NonFiniteWeights, match=rf"has 1 of {n} values NaN or \+-inf \(the first at flat index "
                                                   rf"{at}: "):
            check_finite({"w": w})
