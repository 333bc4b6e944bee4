"""``syncd materialize`` as an operator meets it: the folder gets the modes the umask gives new files (not a private
temporary folder's), its config.json names the dtype of the weights in it (bf16, whatever the trainer's config
said), and an --out that cannot be written is refused before any work, naming the flag."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch

from syncd.app import cli
from syncd.store import Store
from syncd.publish.publisher import WeightPublisher

KEY = "materialize-test-key-0123456789ab"
RUN = "mat"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A make_tiny model whose config says float32 (the trainer's dtype), published as bf16 with its model files."""
    from transformers import AutoModelForCausalLM

    from syncd.engine.reference.make_tiny import write_model

    root = tmp_path_factory.mktemp("mat")
    model_dir = write_model(root / "model")
    config = json.loads((model_dir / "config.json").read_text())
    config["torch_dtype"] = "float32"
    (model_dir / "config.json").write_text(json.dumps(config))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    store = Store(root / "store")
    with WeightPublisher(store, RUN, signing_key=KEY) as pub:
        pub.publish_model_files(model_dir)
        pub.publish(model, 0)
        pub.flush()
    return store


@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    yield 0o027
    os.umask(old)


def test_the_folder_follows_the_umask_and_names_bf16(run, tmp_path, monkeypatch, capsys, umask_027):
    monkeypatch.setenv("SYNCD_SIGNING_KEY", KEY)
    out = tmp_path / "hf"
    assert cli.main(["materialize", "--store", run.url, "--run-id", RUN, "--out", str(out)]) == 0, \
        capsys.readouterr().err
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask_027  # 0750, not a temporary folder's 0700
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert modes and set(modes.values()) == {0o666 & ~umask_027}, modes  # 0640 each, weights included
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16"  # the weights' dtype, though the trainer's config said float32
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}


def test_an_out_that_cannot_be_written_is_refused_before_the_work(run, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SYNCD_SIGNING_KEY", KEY)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    rc = cli.main(["materialize", "--store", run.url, "--run-id", RUN, "--out", str(blocker / "hf")])
    err = capsys.readouterr().err
    assert rc == 2 and f"--out {blocker / 'hf'}: cannot be written" in err, err
    # and before reading the store: a store that does not exist is not what is reported
    rc = cli.main(["materialize", "--store", str(tmp_path / "no-store"), "--run-id", RUN, "--out",
                   str(blocker / "hf")])
    assert rc == 2 and "--out" in capsys.readouterr().err
