"""Materialize, latest_version, verify and the CLI over versions published from real AdamW steps, and
every kind of bad store content: each a named error, and nothing applied."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import pytest

import syncd
from syncd import manifest as mf
from syncd.app.cli import main as cli
from syncd.errors import (BaseVersionMissing, IntegrityError, ManifestError, ManifestMismatch,
                          SignatureError, VersionNotFound)
from syncd.signing import SigningKey
from syncd.store import Store
from syncd.versions import (apply_delta, fetch_shards, latest_version, list_versions, read_manifest,
                            verify_run)
from syncd.publish.publisher import WeightPublisher

from ._models import assert_same, trajectory
from .conftest import KEY

RUN = "run-a"
N = 6  # versions 0 full, 1-2 delta, 3 full, 4-5 delta


def publish_all(store, run=RUN, states=None, key=KEY, **kw):
    states = states if states is not None else trajectory(N)
    kw.setdefault("full_every", 3)
    kw.setdefault("shard_bytes", 64 << 10)
    with WeightPublisher(store, run, signing_key=key, **kw) as pub:
        for step, state in enumerate(states):
            pub.publish(state, step)
    return states


@pytest.fixture
def published(tmp_path):
    root = tmp_path / "store"
    states = publish_all(Store(root))
    return Store(root), root, states


def shard_path(root: Path, version: int, i: int = 0) -> Path:
    m = read_manifest(Store(root), RUN, version, signing_key=KEY)
    return root / mf.run_prefix(RUN) / m.shards[i].key


def manifest_path(root: Path, version: int) -> Path:
    return root / mf.manifest_key(RUN, version)


def test_every_version_materializes_bit_exact(published):
    store, _, states = published
    kinds = [read_manifest(store, RUN, v, signing_key=KEY).kind for v in range(N)]
    assert kinds == ["full", "delta", "delta", "full", "delta", "delta"]
    for v in range(N):
        assert_same(syncd.materialize(store, RUN, v, signing_key=KEY), states[v])
    assert_same(syncd.materialize(store.url, RUN, signing_key=KEY), states[-1])  # default: latest, by URL
    assert syncd.latest_version(store, RUN, signing_key=KEY) == N - 1


def test_full_version_shards_are_plain_safetensors(published):
    from safetensors import safe_open

    store, root, states = published
    m = read_manifest(store, RUN, 3, signing_key=KEY)
    assert len(m.shards) > 1  # 64 KiB shards
    seen = {}
    for s in m.shards:
        with safe_open(str(root / mf.run_prefix(RUN) / s.key), framework="pt") as f:
            assert f.metadata()["format"] == "pt"
            seen.update({k: f.get_tensor(k) for k in f.keys()})
    assert_same({k: seen[k] for k in states[3]}, states[3])


def test_latest_version_skips_a_torn_version(published):
    store, root, _ = published
    store.put(mf.run_prefix(RUN) + mf.shard_key(N, "f" * 16, 0, "delta"), b"partial upload")
    assert latest_version(store, RUN, signing_key=KEY) == N - 1
    assert [i.status for i in list_versions(store, RUN, signing_key=KEY)][-2:] == ["ok", "torn"]
    with pytest.raises(VersionNotFound, match=f"no version {N}"):
        syncd.materialize(store, RUN, N, signing_key=KEY)
    assert latest_version(store, "no-such-run") is None


def test_altered_shard_is_an_integrity_error_and_nothing_is_applied(published):
    store, root, states = published
    path = shard_path(root, 4)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="SHA-256 .* does not match the manifest of version 4.*altered"):
        syncd.materialize(store, RUN, 4, signing_key=KEY)
    with pytest.raises(IntegrityError):
        syncd.materialize(store, RUN, 5, signing_key=KEY)  # its chain goes through version 4
    assert_same(syncd.materialize(store, RUN, 3, signing_key=KEY), states[3])


def test_delta_for_other_weights_is_refused_before_anything_is_written(published):
    store, _, states = published
    m3, m4, m5 = (read_manifest(store, RUN, v, signing_key=KEY) for v in (3, 4, 5))
    weights = syncd.materialize(store, RUN, 3, signing_key=KEY)
    before = {k: v.clone() for k, v in weights.items()}
    with pytest.raises(ManifestMismatch, match="made against a different version 3"):
        apply_delta(weights, m3, m5, fetch_shards(store, RUN, m5))  # skips version 4
    with pytest.raises(IntegrityError, match="applies to version 4, but tensor"):
        apply_delta(weights, m4, m5, fetch_shards(store, RUN, m5))  # claims the weights are version 4
    assert_same(weights, before)
    apply_delta(weights, m3, m4, fetch_shards(store, RUN, m4))
    assert_same(weights, states[4])


def test_altered_manifest_is_a_signature_error(published):
    store, root, states = published
    path = manifest_path(root, 4)
    doc = json.loads(path.read_bytes())
    doc["step"] += 1
    path.write_bytes(mf._canonical(doc))
    with pytest.raises(SignatureError, match="content was altered"):
        syncd.materialize(store, RUN, 4, signing_key=KEY)
    with pytest.raises(SignatureError):
        syncd.materialize(store, RUN, 5, signing_key=KEY)  # its chain goes through version 4
    assert_same(syncd.materialize(store, RUN, 3, signing_key=KEY), states[3])


def test_manifest_resigned_with_wrong_key_is_a_signature_error(published, caplog):
    store, root, states = published
    m = read_manifest(store, RUN, 5, signing_key=KEY)
    manifest_path(root, 5).write_bytes(replace(m, step=999).encode(SigningKey(b"attacker-key-0123456789")))
    with pytest.raises(SignatureError, match="names key id"):
        syncd.materialize(store, RUN, 5, signing_key=KEY)
    # the newest *valid* version is 4: the forged 5 is skipped and reported, never taken as the newest
    with caplog.at_level(logging.WARNING, logger="syncd.newest"):
        assert latest_version(store, RUN, signing_key=KEY) == 4
    assert "version 5 skipped: SignatureError" in caplog.text
    assert_same(syncd.materialize(store, RUN, signing_key=KEY), states[4])


def test_unsigned_manifests_rejected_when_reader_has_a_key(tmp_path):
    store = Store(tmp_path)
    states = publish_all(store, key=False)
    assert_same(syncd.materialize(store, RUN, signing_key=False), states[-1])
    with pytest.raises(SignatureError, match="unsigned"):
        syncd.materialize(store, RUN, signing_key=KEY)


def test_a_keyless_reader_reads_a_signed_run_only_when_told_to_leave_it_unchecked(published, monkeypatch, capsys):
    from syncd.signing import UNCHECKED

    store, root, states = published
    monkeypatch.delenv("SYNCD_SIGNING_KEY", raising=False)
    with pytest.raises(SignatureError, match="no signing key is configured"):
        read_manifest(store, RUN, 2, signing_key=False)
    assert read_manifest(store, RUN, 2, signing_key=UNCHECKED).version == 2
    assert latest_version(store, RUN, signing_key=UNCHECKED) == N - 1
    assert_same(syncd.materialize(store, RUN, 2, signing_key=UNCHECKED), states[2])
    capsys.readouterr()
    assert cli(["ls", "--store", str(root), "--run-id", RUN, "--allow-unsigned"]) == 0
    assert "version" in capsys.readouterr().out.lower()


def test_key_from_environment(published, monkeypatch):
    store, _, states = published
    monkeypatch.setenv("SYNCD_SIGNING_KEY", KEY)
    assert_same(syncd.materialize(store, RUN, 2), states[2])
    monkeypatch.setenv("SYNCD_SIGNING_KEY", "another-key-that-is-long-enough")
    with pytest.raises(SignatureError):
        syncd.materialize(store, RUN, 2)


def test_replayed_manifest_is_rejected(published):
    store, root, _ = published
    old = manifest_path(root, 2).read_bytes()
    manifest_path(root, 5).write_bytes(old)  # an old, correctly signed manifest in the newest slot
    with pytest.raises(ManifestMismatch, match="names version 2 but was found at version 5"):
        syncd.materialize(store, RUN, 5, signing_key=KEY)
    other = root / mf.manifest_key("run-b", 2)
    other.parent.mkdir(parents=True)
    other.write_bytes(old)  # the same manifest under another run
    with pytest.raises(ManifestMismatch, match="names run 'run-a' but was found under run 'run-b'"):
        syncd.materialize(store, "run-b", 2, signing_key=KEY)


@pytest.mark.parametrize("gone", [3, 4])
def test_delta_whose_base_is_missing(published, gone):
    store, root, _ = published
    manifest_path(root, gone).unlink()
    with pytest.raises(BaseVersionMissing, match=f"needs base version {gone}, which is not in"):
        syncd.materialize(store, RUN, 5, signing_key=KEY)


def test_base_replaced_by_another_version_breaks_the_chain(published):
    store, root, _ = published
    m4 = read_manifest(store, RUN, 4, signing_key=KEY)
    manifest_path(root, 4).write_bytes(replace(m4, step=m4.step + 100).encode(SigningKey(KEY.encode())))
    assert read_manifest(store, RUN, 4, signing_key=KEY).step == m4.step + 100  # valid on its own
    with pytest.raises(ManifestMismatch, match="made against a different version 4"):
        syncd.materialize(store, RUN, 5, signing_key=KEY)


def test_shard_deleted_under_a_reader_is_version_not_found(published):
    store, root, _ = published
    shard_path(root, 5).unlink()
    with pytest.raises(VersionNotFound, match="a shard of version 5, is gone"):
        syncd.materialize(store, RUN, 5, signing_key=KEY)


def test_oversized_objects_are_refused_without_reading_them_whole(published, monkeypatch):
    store, root, _ = published
    path = shard_path(root, 4)
    path.write_bytes(path.read_bytes() + b"x" * 100_000)
    with pytest.raises(IntegrityError, match="shard of version 4 does not match its manifest: .* bytes, expected"):
        syncd.materialize(store, RUN, 4, signing_key=KEY)
    monkeypatch.setattr(mf, "MAX_MANIFEST_BYTES", 1000)
    with pytest.raises(ManifestError, match="bytes, over the 1000-byte limit; not read"):
        read_manifest(store, RUN, 3, signing_key=KEY)  # one ranged GET, its body left unread


def test_verify_run_names_exactly_the_broken_versions(published):
    store, root, _ = published
    path = shard_path(root, 1)
    path.write_bytes(path.read_bytes()[:-1] + b"\0")
    report = list(verify_run(store, RUN, signing_key=KEY))
    status = {v: s for v, s, _ in report}
    assert status == {0: "ok", 1: "failed", 2: "failed", 3: "ok", 4: "ok", 5: "ok"}
    assert "IntegrityError" in dict((v, msg) for v, _, msg in report)[1]
    quick = {v: s for v, s, _ in verify_run(store, RUN, signing_key=KEY, deep=False)}
    assert set(quick.values()) == {"ok"}  # sizes are right; only the deep check reads the bytes


def test_cli_ls_verify_gc(published, capsys, monkeypatch):
    store, root, _ = published
    monkeypatch.setenv("SYNCD_SIGNING_KEY", KEY)
    monkeypatch.setenv("SYNCD_STORE", str(root / "wrong"))  # the flag must win over the environment
    assert cli(["ls", "--store", str(root)]) == 0
    assert capsys.readouterr().out.split() == [RUN]
    assert cli(["ls", "--store", str(root), "--run-id", RUN, "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["version"], r["kind"], r["status"]) for r in rows] == [
        (0, "full", "ok"), (1, "delta", "ok"), (2, "delta", "ok"), (3, "full", "ok"), (4, "delta", "ok"),
        (5, "delta", "ok")]
    assert all(r["signed_by"] == SigningKey(KEY.encode()).key_id for r in rows)
    monkeypatch.setenv("SYNCD_STORE", str(root))
    monkeypatch.setenv("SYNCD_RUN_ID", RUN)
    assert cli(["verify"]) == 0
    assert capsys.readouterr().out.strip().endswith("6 versions checked, 0 failed")
    assert cli(["gc", "--keep-last", "1", "--grace", "0", "--dry-run"]) == 0
    assert "would delete versions 0-2 (" in capsys.readouterr().out
    assert cli(["gc", "--keep-last", "1", "--dry-run"]) == 0  # the default grace keeps everything, and says so
    out = capsys.readouterr().out.splitlines()
    assert out[:4] == ["keep versions 0-5", "  5: the newest 1 (--keep-last)",
                       "  3-4: the full version and deltas a kept version is built from",
                       "  0-2: superseded less than 300 s ago, a reader may still use them (--grace)"], out
    assert out[4].startswith("would delete versions none (0 objects)")
    assert latest_version(store, RUN, signing_key=KEY) == 5 and len(list_versions(store, RUN)) == 6
    shard_path(root, 4).write_bytes(b"garbage")
    assert cli(["verify", "--quick"]) == 1
    out = capsys.readouterr().out
    assert "4 FAILED" in out and "5 ok" in out
    assert cli(["verify", "--version", "3"]) == 0
    capsys.readouterr()
    assert cli(["verify", "--run-id", "nope"]) == 1
    assert f"run 'nope' has no versions in file://{root}; runs there: {RUN}" in capsys.readouterr().err
    for command in (["ls"], ["gc", "--dry-run"]):  # an unknown run is an error, named, with the runs there are
        assert cli(command + ["--run-id", "nope"]) == 1
        assert f"runs there: {RUN}" in capsys.readouterr().err
    assert cli(["ls", "--run-id", "../etc"]) == 2
    assert "--run-id='../etc' is not a run id" in capsys.readouterr().err
    assert cli([]) == 2
    assert cli(["ls", "--store", str(root / "typo")]) == 2
    assert "does not exist" in capsys.readouterr().err and not (root / "typo").exists()
