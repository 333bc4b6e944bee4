"""The manifest: canonical signed JSON, strict parsing of hostile bytes, replay and schema checks."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from syncd import manifest as mf
from syncd.errors import ManifestError, ManifestMismatch, SignatureError
from syncd.signing import SigningKey, key_from_env, parse_key

KEY = SigningKey(b"k" * 32)
OTHER = SigningKey(b"o" * 32)
SESSION = "0123456789abcdef"


def sample(version=3, kind="delta", run_id="run-1") -> mf.Manifest:
    shard = mf.ShardEntry(mf.shard_key(version, SESSION, 0, kind), 300, "a" * 64, mf.SHARD_FORMATS[kind])
    tensors = (mf.TensorEntry("w", "bfloat16", (10, 5), 0, 0, 100, 0x1234),
               mf.TensorEntry("b", "float32", (5,), 0, 100, 20, 0xFFFFFFFFFFFFFFFF))
    base = (version - 1, "b" * 64) if kind == "delta" else (None, None)
    return mf.Manifest(run_id, version, kind, *base, 42, "2026-01-02T03:04:05.000006Z", SESSION, tensors,
                       (shard,))


def reencode(raw: bytes, edit) -> bytes:
    doc = json.loads(raw)
    edit(doc)
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def test_roundtrip_signed():
    m = sample()
    raw = m.encode(KEY)
    got = mf.parse(raw, key=KEY, run_id="run-1", version=3)
    assert got == m and got.signed_by == KEY.key_id and got.digest == mf.digest(raw)
    assert json.loads(raw)["schema_version"] == mf.SCHEMA_VERSION


def test_unsigned_manifest_rejected_when_a_key_is_configured():
    raw = sample().encode(None)
    assert mf.parse(raw, key=None).signed_by is None  # accepted when no key is configured
    with pytest.raises(SignatureError, match="unsigned, but a signing key is configured"):
        mf.parse(raw, key=KEY)


def test_manifest_signed_with_another_key_rejected_naming_both_keys():
    raw = sample().encode(OTHER)
    with pytest.raises(SignatureError, match=f"names key id '{OTHER.key_id}'.*configured key is {KEY.key_id}"):
        mf.parse(raw, key=KEY)


def test_altered_manifest_rejected():
    raw = reencode(sample().encode(KEY), lambda d: d.update(step=43))
    with pytest.raises(SignatureError, match="content was altered"):
        mf.parse(raw, key=KEY)


def test_altered_manifest_resigned_with_wrong_key_rejected():
    def forge(d):
        d.pop("signature")
        d["tensors"][0]["checksum"] = "0" * 16
        d["signature"] = {"alg": "hmac-sha256", "key_id": KEY.key_id,  # claims our key id
                          "mac": OTHER.sign(mf._signed_message(d)("hmac-sha256", KEY.key_id))}

    with pytest.raises(SignatureError, match="does not verify"):
        mf.parse(reencode(sample().encode(KEY), forge), key=KEY)


@pytest.mark.parametrize("run_id,version,match", [("run-2", 3, "names run 'run-1'"),
                                                  ("run-1", 4, "names version 3 but was found at version 4")])
def test_replayed_manifest_rejected(run_id, version, match):
    with pytest.raises(ManifestMismatch, match=match):
        mf.parse(sample().encode(KEY), key=KEY, run_id=run_id, version=version)


@pytest.mark.parametrize("raw,match", [
    (b"[1, 2]", "not a JSON object"),
    (b'{"a": 1, "a": 2}', "duplicate member"),
    (b'{"a": 1.5}', "non-integer number"),
    (b'{"a": NaN}', "NaN is not a JSON value"),
    (b"\xff\xfe", "not ASCII text"),
    (b'{"a":1} ', "not in canonical form"),
    (b'{"b":1,"a":2}', "not in canonical form"),
    (b'{"a":1}', "no 'signature' member"),
    (b"[" * 100000 + b"]" * 100000, "nested deeper"),
    (b'{"a":' * 7 + b"1" + b"}" * 7, "nested deeper than 6 levels"),
])
def test_malformed_bytes_are_manifest_errors(raw, match):
    with pytest.raises(ManifestError, match=match):
        mf.parse(raw, key=None)


def test_oversized_manifest_rejected_before_parsing():
    with pytest.raises(ManifestError, match="over the"):
        mf.parse(b" " * (mf.MAX_MANIFEST_BYTES + 1), key=None)


BAD_EDITS = {
    "schema version": (lambda d: d.update(schema_version=2), "schema_version 2 is not supported"),
    "bool version": (lambda d: d.update(version=True), "version must be an integer"),
    "negative step": (lambda d: d.update(step=-1), "step must be an integer"),
    "kind": (lambda d: d.update(kind="partial"), "kind must be one of"),
    "base after version": (lambda d: d.update(base_version=3), "base_version must be an integer in 0..2"),
    "unknown member": (lambda d: d.update(extra=1), "unknown members \\['extra'\\]"),
    "missing member": (lambda d: d.pop("step"), "missing members \\['step'\\]"),
    "created_at": (lambda d: d.update(created_at="yesterday"), "not an RFC 3339"),
    "path traversal": (lambda d: d["shards"][0].update(key="versions/000000000003/shards/../../x"), "not a delta shard key"),
    "other version's shard": (lambda d: d["shards"][0].update(key=mf.shard_key(2, SESSION, 0, "delta")), "not a delta shard key"),
    "range past shard": (lambda d: d["tensors"][1].update(length=281), "exceeds shard 0"),
    "overlap": (lambda d: d["tensors"][1].update(offset=50), "overlap"),
    "shard index": (lambda d: d["tensors"][0].update(shard=1), "shard must be an integer in 0..0"),
    "dtype": (lambda d: d["tensors"][0].update(dtype="complex64"), "is not one of"),
    "checksum": (lambda d: d["tensors"][0].update(checksum="xyz"), "checksum is not a valid string"),
    "duplicate tensor": (lambda d: d["tensors"][1].update(name="w"), "appears twice"),
    "no tensors": (lambda d: d.update(tensors=[]), "tensors must be a list of 1.."),
    "rank": (lambda d: d["tensors"][0].update(shape=[1] * 9), "at most 8 dimensions"),
    "sha": (lambda d: d["shards"][0].update(sha256="A" * 64), "sha256 is not a valid string"),
}


@pytest.mark.parametrize("name", sorted(BAD_EDITS))
def test_schema_violations_are_named(name):
    edit, match = BAD_EDITS[name]

    def apply(d):
        d.pop("signature")
        edit(d)
        d["signature"] = None

    with pytest.raises(ManifestError, match=match):
        mf.parse(reencode(sample().encode(None), apply), key=None)


def test_full_version_tensor_length_must_match_dtype_and_shape():
    m = sample(kind="full")
    assert mf.parse(m.encode(None), key=None) == m  # 10x5 bf16 = 100 bytes, 5 float32 = 20 bytes
    bad = mf.Manifest(**{**m.__dict__, "tensors": (m.tensors[0], mf.TensorEntry("b", "float32", (6,), 0, 100, 20, 1))})
    with pytest.raises(ManifestError, match="20 bytes for a float32 tensor of shape \\[6\\]"):
        bad.encode(None)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_any_corruption_of_a_signed_manifest_is_rejected_cleanly(data):
    raw = bytearray(sample().encode(KEY))
    positions = data.draw(st.sets(st.integers(0, len(raw) - 1), min_size=1, max_size=4))
    for i in positions:  # distinct positions: a second edit of one byte could put the original back
        raw[i] = data.draw(st.integers(0, 255).filter(lambda b, old=raw[i]: b != old))
    with pytest.raises(ManifestError):  # SignatureError and ManifestMismatch are ManifestErrors
        mf.parse(bytes(raw), key=KEY, run_id="run-1", version=3)


def test_layout_keys():
    assert mf.manifest_key("r", 7) == "runs/r/versions/000000000007/manifest.json"
    assert mf.shard_key(7, SESSION, 2, "full") == f"versions/000000000007/shards/{SESSION}-00002.safetensors"
    assert mf.parse_version_dir("000000000007/") == 7 and mf.parse_version_dir("7") is None
    for bad in ("", "../x", "a/b", "a" * 129, ".hidden", "a..b"):
        with pytest.raises(ValueError, match="invalid run id"):
            mf.run_prefix(bad)


def test_signing_keys(tmp_path):
    assert parse_key("hex:" + "ab" * 16).secret == b"\xab" * 16
    assert parse_key("base64:" + "QUFBQUFBQUFBQUFBQUFBQQ==").secret == b"A" * 16
    with pytest.raises(ValueError, match="at least 16"):
        parse_key("short")
    with pytest.raises(ValueError, match="not valid hex"):
        parse_key("hex:zz")
    f = tmp_path / "key"
    f.write_text("k" * 32 + "\n")
    assert key_from_env({"SYNCD_SIGNING_KEY_FILE": str(f)}).secret == b"k" * 32
    assert key_from_env({"SYNCD_SIGNING_KEY": "k" * 20, "SYNCD_SIGNING_KEY_FILE": str(f)}).secret == b"k" * 20
    assert key_from_env({}) is None
    with pytest.raises(ValueError, match="cannot be read"):
        key_from_env({"SYNCD_SIGNING_KEY_FILE": str(tmp_path / "missing")})
    assert "k" * 32 not in repr(KEY) and KEY.key_id == SigningKey(b"k" * 32).key_id != OTHER.key_id
