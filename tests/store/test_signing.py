"""Public-key manifests: ``syncd keygen``, the key files, readers / daemons / engines that verify with public
keys only, the forging test (a party holding every public key cannot make a manifest any reader accepts), key
rotation by key id, and the legacy HMAC form still read and named as such."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import io
import json
import stat
from dataclasses import replace

import pytest
import torch

from syncd import engine
from syncd import manifest as mf
from syncd.app.cli import main as cli
from syncd.cache import ShardCache
from syncd.daemon import DaemonConfig, NodeDaemon
from syncd.engines.control import EngineControl
from syncd.errors import SignatureError
from syncd.publish.publisher import WeightPublisher
from syncd.signing import Keyring, PrivateKey, PublicKey, SigningKey, key_from_env
from syncd.signing.keyfiles import format_private, format_public, read_public_key_file
from syncd.store import Store
from syncd.versions import fetch_shards, list_versions, materialize, read_manifest
from tests.daemon._procs import wait_until

from ._models import assert_same, trajectory

RUN = "signed"
TOKEN = "t" * 64


def keygen(tmp_path, name: str):
    """``syncd keygen --out tmp_path/name``: (key id printed, private key file, public key file)."""
    prefix, out = tmp_path / name, io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli(["keygen", "--out", str(prefix)]) == 0
    return out.getvalue().splitlines()[0], prefix.with_suffix(".key"), prefix.with_suffix(".pub")


def publish(root, key, states, first_step: int = 0) -> list[int]:
    """Publish ``states`` (steps from ``first_step``) with ``key``; returns the versions written."""
    with WeightPublisher(Store(root), RUN, signing_key=key, full_every=3, shard_bytes=16 << 10) as pub:
        versions = []
        for i, s in enumerate(states):
            pub.publish(s, first_step + i)
            pub.flush()
            versions.append(pub.last_version)
    return versions


def raw_manifest(root, version: int) -> bytes:
    return Store(root).get(mf.manifest_key(RUN, version))


# ---------------------------------------------------------------------------------------------- keygen


def test_keygen_writes_a_private_key_only_its_owner_reads_and_a_public_key(tmp_path, capsys):
    key_id, private, public = keygen(tmp_path, "run")
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    priv, pub = key_from_env({"SYNCD_SIGNING_KEY_FILE": str(private)}), read_public_key_file(public, "--verify-key")
    assert isinstance(priv, PrivateKey) and isinstance(pub, PublicKey)
    assert priv.key_id == pub.key_id == key_id and len(key_id) == 16
    assert public.read_text() == format_public(pub) and private.read_text() == format_private(priv)
    assert priv.seed().hex() not in repr(priv) and key_id in repr(priv)
    before = private.read_bytes()
    assert cli(["keygen", "--out", str(tmp_path / "run")]) == 2  # never overwrites a key
    assert "exists" in capsys.readouterr().err and private.read_bytes() == before


def test_wrong_key_files_are_refused_naming_the_flag_and_the_problem(tmp_path):
    _, private, public = keygen(tmp_path, "k")
    line = public.read_text()
    cases = {
        "private.key": (private.read_text(), "holds a private key"),
        "edited.pub": (line.replace(line.split(":")[1], "0" * 16), "key id 0000000000000000 written in it is not"),
        "typo.pub": (line.replace("ed25519-public", "ed25519-publik"), "not a valid ed25519 key line"),
        "short.pub": (line[:-10] + "\n", "not a valid ed25519 key line"),
        "pem.pub": ("-----BEGIN PUBLIC KEY-----\nMCow\n-----END PUBLIC KEY-----\n", "PEM file is not read"),
        "hmac.pub": ("a-legacy-shared-secret-0123456789\n", "is not an ed25519 public key file"),
    }
    for name, (text, why) in cases.items():
        path = tmp_path / name
        path.write_text(text)
        with pytest.raises(ValueError, match=f"^SYNCD_VERIFY_KEYS='{path}'.*{why}"):
            key_from_env({"SYNCD_VERIFY_KEYS": f"{public},{path}"})
    with pytest.raises(ValueError, match="^SYNCD_VERIFY_KEYS=.*cannot be read"):
        key_from_env({"SYNCD_VERIFY_KEYS": str(tmp_path / "missing.pub")})
    (tmp_path / "typo.key").write_text(private.read_text().replace("private", "privat"))
    with pytest.raises(ValueError, match="^SYNCD_SIGNING_KEY_FILE=.*not a valid ed25519 key line"):
        key_from_env({"SYNCD_SIGNING_KEY_FILE": str(tmp_path / "typo.key")})
    with pytest.raises(ValueError, match="^SYNCD_SIGNING_KEY: not a valid ed25519 key line"):
        key_from_env({"SYNCD_SIGNING_KEY": "ed25519-private:abc"})


# ---------------------------------------------------------------------------------------------- verifying


def test_readers_verify_with_public_keys_only(tmp_path, capsys):
    key_id, private, public = keygen(tmp_path, "run")
    states = trajectory(4)
    root = tmp_path / "store"
    publish(root, key_from_env({"SYNCD_SIGNING_KEY_FILE": str(private)}), states)
    reader = key_from_env({"SYNCD_VERIFY_KEYS": str(public)})
    assert isinstance(reader, Keyring) and reader.signer is None and list(reader.accepted) == [key_id]
    m = read_manifest(root, RUN, 3, signing_key=reader)
    assert (m.signed_by, m.signature_alg, m.signature_text) == (key_id, "ed25519", f"signed ed25519 key {key_id}")
    assert json.loads(raw_manifest(root, 3))["signature"]["alg"] == "ed25519"  # new runs default to Ed25519
    assert_same(materialize(root, RUN, 3, signing_key=read_public_key_file(public, "test")), states[3])
    # the commands, with the public key given as a flag
    assert cli(["verify", "--store", str(root), "--run-id", RUN, "--verify-key", str(public)]) == 0
    assert f"signed ed25519 key {key_id}" in capsys.readouterr().out
    assert cli(["ls", "--store", str(root), "--run-id", RUN, "--verify-key", str(public)]) == 0
    assert capsys.readouterr().out.count(f"ok (signed ed25519 key {key_id})") == 4
    assert cli(["ls", "--store", str(root), "--run-id", RUN]) == 2  # no key: one summary, saying what to pass
    assert "versions 0-3 are signed" in capsys.readouterr().err


def test_a_party_holding_every_public_key_cannot_forge_a_manifest(tmp_path):
    """Everything a verifier holds -- every public key, their files, every real manifest -- and every way it
    could sign: no forged manifest is accepted by any reader, whatever keys that reader holds."""
    _, private_a, public_a = keygen(tmp_path, "a")
    _, _, public_b = keygen(tmp_path, "b")
    root = tmp_path / "store"
    publish(root, key_from_env({"SYNCD_SIGNING_KEY_FILE": str(private_a)}), trajectory(2))
    forger = key_from_env({"SYNCD_VERIFY_KEYS": f"{public_a},{public_b}"})
    real = raw_manifest(root, 1)
    m = mf.parse(real, key=forger)
    evil = replace(m, step=m.step + 1000)
    with pytest.raises(ValueError, match="cannot sign: only public keys"):
        evil.encode(forger)
    with pytest.raises(ValueError, match="cannot sign: only public keys"):
        WeightPublisher(Store(root), RUN, signing_key=forger)  # refused when it starts, not at its first version
    body = evil.body()
    message = mf._signed_message(body)  # noqa: SLF001 -- the exact bytes a signature covers

    def doc(signature) -> bytes:
        return mf._canonical({**body, "signature": signature})  # noqa: SLF001

    attempts = [doc(None), doc(json.loads(real)["signature"])]  # unsigned; a real signature moved over
    for pub in (forger.accepted.values()):
        for secret in (pub.raw, public_a.read_bytes(), public_b.read_bytes(), pub.key_id.encode() * 2):
            for alg, key_id in (("hmac-sha256", pub.key_id), ("hmac-sha256", SigningKey(secret).key_id)):
                mac = hmac.new(secret, message(alg, key_id), hashlib.sha256).hexdigest()
                attempts.append(doc({"alg": alg, "key_id": key_id, "mac": mac}))
        other = PrivateKey.generate()  # a key of its own, claiming a real key id
        sig = other.sign(message("ed25519", pub.key_id))
        attempts.append(doc({"alg": "ed25519", "key_id": pub.key_id, "sig": sig}))
        attempts.append(doc({"alg": "ed25519", "key_id": pub.key_id, "sig": "00" * 64}))
    readers = [forger, read_public_key_file(public_a, "t"), Keyring(None, [read_public_key_file(public_b, "t")]),
               key_from_env({"SYNCD_SIGNING_KEY_FILE": str(private_a)})]
    for raw in attempts:
        for reader in readers:
            with pytest.raises(SignatureError):
                mf.parse(raw, key=reader, run_id=RUN, version=1)
    assert mf.parse(real, key=readers[1], run_id=RUN, version=1).step == m.step  # the real one still reads


def test_key_rotation_accepts_both_keys_by_key_id_and_names_an_unknown_one(tmp_path, capsys):
    old_id, old_private, old_public = keygen(tmp_path, "old")
    new_id, new_private, new_public = keygen(tmp_path, "new")
    _, _, stranger = keygen(tmp_path, "stranger")
    states = trajectory(4)
    root = tmp_path / "store"
    assert publish(root, key_from_env({"SYNCD_SIGNING_KEY_FILE": str(old_private)}), states[:2]) == [0, 1]
    # the publisher rotates: signs with the new key, still accepts the old one's versions (it reads them to resume)
    rotated = key_from_env({"SYNCD_SIGNING_KEY_FILE": str(new_private), "SYNCD_VERIFY_KEYS": str(old_public)})
    assert isinstance(rotated, Keyring) and rotated.key_id == new_id and set(rotated.accepted) == {old_id, new_id}
    assert publish(root, rotated, states[2:], first_step=2) == [2, 3]
    both = key_from_env({"SYNCD_VERIFY_KEYS": f"{new_public}, {old_public}"})
    assert [i.manifest.signed_by for i in list_versions(root, RUN, signing_key=both)] == [old_id] * 2 + [new_id] * 2
    assert_same(materialize(root, RUN, 3, signing_key=both), states[3])
    assert cli(["verify", "--quick", "--store", str(root), "--run-id", RUN, "--verify-key", str(old_public),
                "--verify-key", str(new_public)]) == 0
    capsys.readouterr()
    # a reader that knows only the new key refuses the old versions, naming the key id they carry
    with pytest.raises(SignatureError, match=f"names key id '{old_id}', which is not accepted: the configured "
                                             f"key is {new_id}"):
        read_manifest(root, RUN, 1, signing_key=read_public_key_file(new_public, "t"))
    with pytest.raises(SignatureError, match=f"names key id '{new_id}'"):
        read_manifest(root, RUN, 3, signing_key=read_public_key_file(stranger, "t"))
    assert cli(["verify", "--quick", "--store", str(root), "--run-id", RUN, "--verify-key", str(stranger)]) == 1
    out = capsys.readouterr().out
    assert f"names key id '{old_id}'" in out and f"names key id '{new_id}'" in out


def test_legacy_hmac_manifests_are_still_read_and_named_legacy(tmp_path, capsys):
    legacy = SigningKey(b"a-legacy-shared-secret-0123456789")
    _, new_private, new_public = keygen(tmp_path, "new")
    states = trajectory(4)
    root = tmp_path / "store"
    publish(root, legacy, states[:2])
    # migration: the publisher moves to Ed25519; readers hold the legacy secret and the new public key
    publish(root, Keyring(PrivateKey(key_from_env({"SYNCD_SIGNING_KEY_FILE": str(new_private)}).seed()), [legacy]),
            states[2:], first_step=2)
    reader = Keyring(legacy, [read_public_key_file(new_public, "t")])
    algs = [i.manifest.signature_alg for i in list_versions(root, RUN, signing_key=reader)]
    assert algs == ["hmac-sha256", "hmac-sha256", "ed25519", "ed25519"]
    assert_same(materialize(root, RUN, 3, signing_key=reader), states[3])
    secret = tmp_path / "legacy.secret"
    secret.write_text("a-legacy-shared-secret-0123456789\n")
    args = ["--store", str(root), "--run-id", RUN, "--signing-key-file", str(secret), "--verify-key", str(new_public)]
    assert cli(["ls", *args]) == 0
    out = capsys.readouterr().out
    assert out.count(f"ok (signed hmac-sha256 (legacy) key {legacy.key_id})") == 2
    assert out.count("ok (signed ed25519 key") == 2
    assert cli(["verify", "--quick", *args]) == 0
    assert capsys.readouterr().out.count("signed hmac-sha256 (legacy) key") == 2
    assert cli(["ls", "--json", *args]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["signature"] for r in rows] == algs


# ---------------------------------------------------------------------------------------------- daemon, engine


def test_the_node_daemon_verifies_with_a_public_key_and_never_applies_a_forgery(tmp_path):
    key_id, private, public = keygen(tmp_path, "run")
    states = trajectory(3)
    root = tmp_path / "store"
    publish(root, key_from_env({"SYNCD_SIGNING_KEY_FILE": str(private)}), states)
    # a forgery at version 3, signed by a key the daemon's holder could make for itself
    m2 = mf.parse(raw_manifest(root, 2), key=read_public_key_file(public, "t"))
    shards = tuple(replace(s, key=s.key.replace(mf.version_dir(2), mf.version_dir(3))) for s in m2.shards)
    forged = replace(m2, version=3, step=99, shards=shards).encode(PrivateKey.generate())
    Store(root).put(mf.manifest_key(RUN, 3), forged)
    inner = engine.StateDictEngine({k: torch.zeros_like(v) for k, v in states[0].items()}, None)
    cfg = DaemonConfig(run_id=RUN, cache_dir=tmp_path / "cache", poll_interval_s=0.05, engine_check_s=0.1)
    d = NodeDaemon(cfg, adapters={"e": inner}, store=Store(root),
                   signing_key=key_from_env({"SYNCD_VERIFY_KEYS": str(public)}))

    async def main():
        task = asyncio.ensure_future(d.run())
        await wait_until(lambda: inner.version == 2, "version 2")
        await asyncio.sleep(0.5)  # several more polls: the forged version 3 stays refused
        d.request_stop()
        await task

    asyncio.run(main())
    assert inner.version == 2
    assert_same(inner.state_dict(), states[2])


def test_an_engine_verifies_with_a_public_key(tmp_path):
    key_id, private, public = keygen(tmp_path, "run")
    states = trajectory(2)
    root = tmp_path / "store"
    publish(root, key_from_env({"SYNCD_SIGNING_KEY_FILE": str(private)}), states[:1])
    cache = ShardCache(tmp_path / "cache")
    m0 = read_manifest(root, RUN, 0, signing_key=read_public_key_file(public, "t"))
    for s, data in zip(m0.shards, fetch_shards(Store(root), RUN, m0)):
        cache.put(s.sha256, data)
    eng = engine.StateDictEngine({k: torch.zeros_like(v) for k, v in states[0].items()}, None)
    control = EngineControl(eng, token=TOKEN, signing_key=key_from_env({"SYNCD_VERIFY_KEYS": str(public)}))
    lease = {"lease": {"holder": "holder-a", "run_id": RUN, "pid": 1, "ttl_s": 30}}
    control.call("pause", lease, TOKEN)
    forged = replace(m0, step=99).encode(PrivateKey.generate())
    with pytest.raises(SignatureError, match="names key id"):
        control.call("load_full", {**lease, "manifest": forged.decode(), "cache_root": str(cache.root)}, TOKEN)
    assert eng.version is None
    real = raw_manifest(root, 0).decode()
    assert control.call("load_full", {**lease, "manifest": real, "cache_root": str(cache.root)}, TOKEN)["version"] == 0
    assert_same(eng.state_dict(), states[0])
