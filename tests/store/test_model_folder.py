"""A version as a Hugging Face folder: ``syncd materialize`` output that transformers' ``from_pretrained`` loads bit
for bit, the model files the publisher stores with a run, and the errors of each way it can go wrong."""

from __future__ import annotations

import json

import pytest
import torch

from syncd.app import cli
from syncd.errors import IntegrityError, SignatureError
from syncd.model_folder import get_model_files, materialize_folder, put_model_files
from syncd.store import Store
from syncd.versions import materialize
from syncd.publish.publisher import WeightPublisher

KEY = "model-folder-test-key-0123456789"
RUN = "hf"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A make_tiny model folder, and a run of it: v0 full, then deltas of real AdamW steps (full_every 3, so the
    newest version is a delta on a full one), the publisher storing the folder's config and tokenizer."""
    from transformers import AutoModelForCausalLM

    from syncd.engine.reference.make_tiny import write_model

    root = tmp_path_factory.mktemp("hf")
    model_dir = write_model(root / "model")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    store = Store(root / "store")
    with WeightPublisher(store, RUN, signing_key=KEY, full_every=3, shard_bytes=16 << 10) as pub:
        pub.publish_model_files(model_dir)
        for step in range(5):
            if step:
                x = torch.randint(0, model.config.vocab_size, (2, 16), generator=gen)
                model(input_ids=x, labels=x).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            pub.publish(model, step)
        pub.flush()
        last = pub.last_version
    return model_dir, store, last


def _load(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).state_dict()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("shard", ["5G", "20k"])
def test_from_pretrained_loads_every_tensor_bit_exact(trained, tmp_path, shard, capsys, monkeypatch):
    model_dir, store, last = trained
    monkeypatch.setenv("SYNCD_SIGNING_KEY", KEY)
    out = tmp_path / "hf"
    assert cli.main(["materialize", "--store", store.url, "--run-id", RUN, "--out", str(out), "--max-shard-size",
                     shard]) == 0, capsys.readouterr().err
    said = capsys.readouterr().out
    assert f"version {last}" in said and str(out) in said
    want = materialize(store, RUN, last, signing_key=KEY)
    got = _load(out)
    assert set(got) == set(want)  # every tensor of the model, none missing or extra
    assert all(_same(got[k], want[k]) for k in want), [k for k in want if not _same(got[k], want[k])]
    files = sorted(p.name for p in out.iterdir())
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= set(files)
    if shard == "5G":
        assert "model.safetensors" in files and "model.safetensors.index.json" not in files
    else:
        shards = [f for f in files if f.startswith("model-0")]
        assert len(shards) > 1 and all(f.endswith(f"-of-{len(shards):05d}.safetensors") for f in shards)
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(want) and set(index["weight_map"].values()) == set(shards)
    # the tokenizer files are the trainer's, byte for byte (a tokenizer loads from the folder)
    assert (out / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()
    from transformers import AutoTokenizer

    text = "12 34"
    assert AutoTokenizer.from_pretrained(out).encode(text) == AutoTokenizer.from_pretrained(model_dir).encode(text)


def test_an_older_version_and_config_from(trained, tmp_path):
    model_dir, store, _ = trained
    done = materialize_folder(store, RUN, 1, tmp_path / "v1", config_from=model_dir, signing_key=KEY)
    assert done["version"] == 1
    want = materialize(store, RUN, 1, signing_key=KEY)
    got = _load(tmp_path / "v1")
    assert all(_same(got[k], want[k]) for k in want)


def test_a_run_without_model_files_names_config_from(trained, tmp_path, capsys, monkeypatch):
    _, store, _ = trained
    bare = Store(tmp_path / "bare")
    with WeightPublisher(bare, "bare", signing_key=False) as pub:
        pub.publish(materialize(store, RUN, 0, signing_key=KEY), 0)
    monkeypatch.delenv("SYNCD_SIGNING_KEY", raising=False)
    assert cli.main(["materialize", "--store", bare.url, "--run-id", "bare", "--out", str(tmp_path / "o")]) == 2
    assert "--config-from MODEL_DIR" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_out_not_empty_is_refused_and_kept(trained, tmp_path, capsys, monkeypatch):
    _, store, _ = trained
    monkeypatch.setenv("SYNCD_SIGNING_KEY", KEY)
    out = tmp_path / "o"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    assert cli.main(["materialize", "--store", store.url, "--run-id", RUN, "--out", str(out)]) == 2
    assert "not an empty directory" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["mine.txt"]


def test_unknown_run_and_bad_shard_size(trained, tmp_path, capsys, monkeypatch):
    _, store, _ = trained
    monkeypatch.setenv("SYNCD_SIGNING_KEY", KEY)
    assert cli.main(["materialize", "--store", store.url, "--run-id", "nope", "--out", str(tmp_path / "o")]) == 1
    assert "has no versions" in capsys.readouterr().err
    assert cli.main(["materialize", "--store", store.url, "--run-id", RUN, "--out", str(tmp_path / "o"),
                     "--max-shard-size", "big"]) == 2
    assert "--max-shard-size='big' is not a size" in capsys.readouterr().err


def test_model_files_are_checked(tmp_path):
    store = Store(tmp_path / "s")
    files = {"config.json": b'{"model_type": "qwen2"}', "tokenizer.json": b"{}"}
    put_model_files(store, "r", files, signing_key=KEY)
    assert get_model_files(store, "r", signing_key=KEY) == files
    with pytest.raises(SignatureError, match="no signing key"):
        get_model_files(store, "r", signing_key=False)
    with pytest.raises(SignatureError, match="does not verify"):
        get_model_files(store, "r", signing_key="another-key-0123456789abcdef")
    store.put("runs/r/model/files/config.json", b'{"model_type": "evil"}')
    with pytest.raises(IntegrityError, match="config.json does not match"):
        get_model_files(store, "r", signing_key=KEY)
    with pytest.raises(ValueError, match="not a model file name"):
        put_model_files(store, "r", {"../x.json": b"{}"}, signing_key=KEY)
    assert get_model_files(store, "other", signing_key=KEY) == {}
