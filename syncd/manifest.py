"""Object layout of a run and the signed version manifest (schema version 1; see ``docs/layout.md``).

Layout, relative to the store's root::

    runs/<run_id>/latest.json                                   hint: newest version (unsigned, may lag)
    runs/<run_id>/versions/<V:012d>/shards/<session>-<i:05d>.safetensors   full version shard
    runs/<run_id>/versions/<V:012d>/shards/<session>-<i:05d>.sdelta        delta version shard
    runs/<run_id>/versions/<V:012d>/manifest.json               written last, create-if-absent, signed

A version exists exactly when its manifest exists. Shard names carry the writing publisher's random session
id, so two publishers racing for the same version never touch each other's shards; the create-if-absent
manifest put decides which one wins.

The manifest is canonical JSON (sorted keys, no spaces, ASCII, no floats) with one extra member,
``signature``: ``{"alg": "ed25519", "key_id": ..., "sig": ...}`` (or the legacy
``{"alg": "hmac-sha256", "key_id": ..., "mac": ...}``), taken over ``DOMAIN`` + the canonical encoding of
``{"manifest": <every other member>, "alg": ..., "key_id": ...}``; or ``null`` when the publisher had no key
(:mod:`syncd.signing`). A reader parses the bytes
strictly (size bound, no duplicate keys, no NaN, no floats), insists that they are canonical, checks the
signature, then validates every field; only then does it use any of them (:func:`parse`).

Everything here is pure (no I/O) and thread-safe.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone

from syncd import jsonsafe
from syncd.errors import ManifestError, ManifestMismatch
from syncd.signing import check_signature, describe_signature, signature_for

SCHEMA = "syncd.manifest"
SCHEMA_VERSION = 1
DOMAIN = b"syncd.manifest.v1\0"

MAX_MANIFEST_BYTES = 64 << 20
MAX_DEPTH = 6  # manifest > tensors > tensor > shape (> signature): 4 deep; a little room
MAX_HINT_BYTES = 4096
MAX_TENSORS = 1 << 20
MAX_SHARDS = 1 << 16
MAX_NAME_CHARS = 1024
MAX_NDIM = 8
MAX_DIM = 1 << 48
MAX_VERSION = 10**12 - 1
MAX_STEP = 1 << 62
MAX_SHARD_BYTES = 1 << 44

KINDS = ("full", "delta")
SHARD_FORMATS = {"full": "safetensors", "delta": "syncd-delta-concat"}
SHARD_EXT = {"full": "safetensors", "delta": "sdelta"}

#: bytes per element of every dtype a manifest may name (torch names, without "torch.").
DTYPE_SIZES = {
    "bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "bool": 1,
}

RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
SESSION_RE = re.compile(r"^[0-9a-f]{16,64}$")
_SHARD_NAME_RE = re.compile(r"^(?P<session>[0-9a-f]{16,64})-(?P<idx>[0-9]{5})\.(?P<ext>safetensors|sdelta)$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_HEX16 = re.compile(r"^[0-9a-f]{16}$")
_VERSION_DIR_RE = re.compile(r"^[0-9]{12}$")


# ---------------------------------------------------------------------------------------------- layout


def check_run_id(run_id) -> str:
    """``run_id`` if it is a valid run id (1-128 of ``[A-Za-z0-9._-]``, starting alphanumeric), else ValueError."""
    if not isinstance(run_id, str) or not RUN_ID_RE.match(run_id) or ".." in run_id:
        raise ValueError(
            f"invalid run id {run_id!r}: use 1-128 characters of [A-Za-z0-9._-], starting with a letter or digit"
        )
    return run_id


def run_prefix(run_id: str) -> str:
    return f"runs/{check_run_id(run_id)}/"


def versions_prefix(run_id: str) -> str:
    return run_prefix(run_id) + "versions/"


def version_dir(version: int) -> str:
    """The version's directory relative to the run prefix, e.g. ``versions/000000000042/``."""
    if not isinstance(version, int) or isinstance(version, bool) or not 0 <= version <= MAX_VERSION:
        raise ValueError(f"invalid version number {version!r}: must be an integer in 0..{MAX_VERSION}")
    return f"versions/{version:012d}/"


def manifest_key(run_id: str, version: int) -> str:
    return run_prefix(run_id) + version_dir(version) + "manifest.json"


def latest_hint_key(run_id: str) -> str:
    return run_prefix(run_id) + "latest.json"


def shard_key(version: int, session: str, index: int, kind: str) -> str:
    """Key of a shard relative to the run prefix (the form stored in the manifest)."""
    return f"{version_dir(version)}shards/{session}-{index:05d}.{SHARD_EXT[kind]}"


def parse_version_dir(name: str) -> int | None:
    """The version number of a directory name like ``000000000042`` (trailing '/' allowed), else None."""
    name = name.rstrip("/").rsplit("/", 1)[-1]
    return int(name) if _VERSION_DIR_RE.match(name) else None


def shard_session(key: str) -> str | None:
    """The publisher session id in a shard key, or None if the key is not a shard key."""
    m = _SHARD_NAME_RE.match(key.rsplit("/", 1)[-1])
    return m.group("session") if m else None


# ---------------------------------------------------------------------------------------------- records


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a version: its bytes are ``shards[shard]`` at ``[offset, offset + length)``.

    For a full version those bytes are the raw little-endian tensor data inside the safetensors file; for a
    delta version they are the codec blob that turns the base version's tensor into this one. ``checksum``
    is ``syncd.ops.checksum`` of the resulting tensor (unsigned 64-bit).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    shard: int
    offset: int
    length: int
    checksum: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_SIZES[self.dtype]


@dataclass(frozen=True)
class ShardEntry:
    """One shard object: ``key`` relative to the run prefix, ``size`` in bytes, ``sha256`` of its content."""

    key: str
    size: int
    sha256: str
    format: str


@dataclass(frozen=True)
class Manifest:
    """A parsed, validated manifest. ``digest`` is the SHA-256 (hex) of the exact manifest object bytes
    (set by :func:`parse` and :meth:`encode`; a delta names its base by it). ``signed_by`` and
    ``signature_alg``: the key id and algorithm of the signature :func:`parse` verified (None: unsigned, or
    read without a key)."""

    run_id: str
    version: int
    kind: str
    base_version: int | None
    base_digest: str | None
    step: int
    created_at: str
    session: str
    tensors: tuple[TensorEntry, ...]
    shards: tuple[ShardEntry, ...]
    signed_by: str | None = field(default=None, compare=False)
    digest: str | None = field(default=None, compare=False)
    signature_alg: str | None = field(default=None, compare=False)

    @property
    def total_bytes(self) -> int:
        """Bytes of all shards (what a node downloads for this version, manifest excluded)."""
        return sum(s.size for s in self.shards)

    @property
    def signature_text(self) -> str:
        """How ``syncd ls``/``verify`` name the signature: ``signed ed25519 key ID``, ``signed hmac-sha256
        (legacy) key ID`` or ``unsigned / not checked``."""
        return describe_signature(self.signature_alg, self.signed_by)

    @property
    def created_datetime(self) -> datetime:
        return datetime.fromisoformat(self.created_at.replace("Z", "+00:00"))

    def body(self) -> dict:
        """The JSON members other than ``signature``."""
        return {
            "schema": SCHEMA,
            "schema_version": SCHEMA_VERSION,
            "run_id": self.run_id,
            "version": self.version,
            "kind": self.kind,
            "base_version": self.base_version,
            "base_manifest_sha256": self.base_digest,
            "step": self.step,
            "created_at": self.created_at,
            "publisher_session": self.session,
            "tensors": [
                {"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "shard": t.shard,
                 "offset": t.offset, "length": t.length, "checksum": f"{t.checksum:016x}"}
                for t in self.tensors
            ],
            "shards": [{"key": s.key, "size": s.size, "sha256": s.sha256, "format": s.format}
                       for s in self.shards],
        }

    def encode(self, key) -> bytes:
        """Canonical manifest bytes, signed with ``key`` (a :class:`~syncd.signing.PrivateKey`, a legacy
        :class:`~syncd.signing.SigningKey`, or a :class:`~syncd.signing.Keyring` with a signer), or with
        ``"signature": null`` when None.

        Validates the manifest first (raises :class:`ManifestError` on a writer bug); ``ValueError`` when
        ``key`` cannot sign (public keys only)."""
        body = self.body()
        _validate(body)
        doc = dict(body)
        doc["signature"] = signature_for(_signed_message(body), key) if key is not None else None
        return _canonical(doc)


def now_rfc3339() -> str:
    """Current UTC time as the manifest's ``created_at`` string (microseconds, ``Z``)."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def digest(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


# ---------------------------------------------------------------------------------------------- parsing


def _signed_message(body: dict):
    """``message_for(alg, key_id)``: the bytes a manifest's signature covers -- every member but the
    signature bytes themselves."""
    return lambda alg, key_id: DOMAIN + _canonical({"manifest": body, "alg": alg, "key_id": key_id})


def _canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def _strict_json(raw: bytes, where: str):
    doc = jsonsafe.loads(raw, what=where, max_bytes=MAX_MANIFEST_BYTES, max_depth=MAX_DEPTH, floats=False,
                         ascii_only=True, unique_members=True, error=ManifestError)
    if not isinstance(doc, dict):
        raise ManifestError(f"{where}: manifest is not a JSON object")
    if _canonical(doc) != bytes(raw):
        raise ManifestError(f"{where}: manifest is not in canonical form (it was edited or written by another tool)")
    return doc


def parse(raw: bytes, *, key, run_id: str | None = None, version: int | None = None,
          where: str = "manifest", allow_unsigned: bool = False) -> Manifest:
    """Parse, authenticate and validate manifest bytes read from the store.

    ``run_id`` / ``version``: where the manifest was found; a signed body that names another run or
    version raises :class:`ManifestMismatch` (replay). ``key``: any key object of :mod:`syncd.signing` (public
    keys, a keyring of several selected by key id, a private or legacy key) or None. With a key, a missing or
    wrong signature, or one by a key id not accepted, raises :class:`SignatureError` before any field is
    looked at; without one, a signed manifest raises it too
    unless ``allow_unsigned`` (:func:`syncd.signing.check_signature`). Any other defect raises
    :class:`ManifestError` saying which field is wrong. ``where`` prefixes every message (e.g. the object key).
    """
    raw = bytes(raw)
    doc = _strict_json(raw, where)
    if "signature" not in doc:
        raise ManifestError(f"{where}: manifest has no 'signature' member")
    signature = doc.pop("signature")
    check_signature(_signed_message(doc), signature, key, where, allow_unsigned=allow_unsigned)
    try:
        m = _validate(doc)
    except ManifestError as exc:
        raise ManifestError(f"{where}: {exc}") from None
    if run_id is not None and m.run_id != run_id:
        raise ManifestMismatch(f"{where}: manifest names run {m.run_id!r} but was found under run {run_id!r}")
    if version is not None and m.version != version:
        raise ManifestMismatch(f"{where}: manifest names version {m.version} but was found at version {version}")
    checked = isinstance(signature, dict) and key is not None
    return replace(m, signed_by=signature["key_id"] if checked else None,
                   signature_alg=signature["alg"] if checked else None, digest=digest(raw))


def signature_key_id(raw: bytes) -> str | None:
    """The key id a manifest's signature names (unverified), or None if it is unsigned or malformed."""
    try:
        sig = _strict_json(bytes(raw), "manifest").get("signature")
    except ManifestError:
        return None
    return str(sig.get("key_id"))[:64] if isinstance(sig, dict) else None


def _int(v, what, lo, hi) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise ManifestError(f"{what} must be an integer in {lo}..{hi}, got {v!r:.60}")
    return v


def _str(v, what, pattern=None, max_len=MAX_NAME_CHARS) -> str:
    if not isinstance(v, str) or not 0 < len(v) <= max_len or (pattern is not None and not pattern.match(v)):
        raise ManifestError(f"{what} is not a valid string: {v!r:.80}")
    return v


def _members(obj, what, names) -> None:
    if not isinstance(obj, dict):
        raise ManifestError(f"{what} must be an object")
    if set(obj) != set(names):
        missing, extra = set(names) - set(obj), set(obj) - set(names)
        raise ManifestError(f"{what} has missing members {sorted(missing)} / unknown members {sorted(extra)}")


_BODY = ("schema", "schema_version", "run_id", "version", "kind", "base_version", "base_manifest_sha256",
         "step", "created_at", "publisher_session", "tensors", "shards")


def _validate(doc: dict) -> Manifest:
    """Check every field of a manifest body and build the record; raises ManifestError."""
    _members(doc, "manifest", _BODY)
    if doc["schema"] != SCHEMA:
        raise ManifestError(f"schema is {doc['schema']!r:.60}, expected {SCHEMA!r}")
    if doc["schema_version"] != SCHEMA_VERSION or isinstance(doc["schema_version"], bool):
        raise ManifestError(f"schema_version {doc['schema_version']!r:.20} is not supported (this build reads {SCHEMA_VERSION})")
    run_id = _str(doc["run_id"], "run_id", RUN_ID_RE, 128)
    version = _int(doc["version"], "version", 0, MAX_VERSION)
    kind = doc["kind"]
    if kind not in KINDS:
        raise ManifestError(f"kind must be one of {KINDS}, got {kind!r:.40}")
    if kind == "full":
        if doc["base_version"] is not None or doc["base_manifest_sha256"] is not None:
            raise ManifestError("a full version must have base_version and base_manifest_sha256 null")
        base, base_digest = None, None
    else:
        if version == 0:
            raise ManifestError("version 0 cannot be a delta (it has no earlier version to apply to)")
        base = _int(doc["base_version"], "base_version", 0, version - 1)
        base_digest = _str(doc["base_manifest_sha256"], "base_manifest_sha256", _HEX64, 64)
    step = _int(doc["step"], "step", 0, MAX_STEP)
    created_at = _str(doc["created_at"], "created_at", None, 64)
    try:
        if not created_at.endswith("Z"):
            raise ValueError("not UTC")
        datetime.fromisoformat(created_at[:-1] + "+00:00")
    except ValueError:
        raise ManifestError(f"created_at {created_at!r} is not an RFC 3339 UTC time") from None
    session = _str(doc["publisher_session"], "publisher_session", SESSION_RE, 64)
    prefix = version_dir(version) + "shards/"

    raw_shards = doc["shards"]
    if not isinstance(raw_shards, list) or not 1 <= len(raw_shards) <= MAX_SHARDS:
        raise ManifestError(f"shards must be a list of 1..{MAX_SHARDS} entries")
    shards, keys = [], set()
    for i, s in enumerate(raw_shards):
        what = f"shards[{i}]"
        _members(s, what, ("key", "size", "sha256", "format"))
        key = _str(s["key"], f"{what}.key", None, 256)
        m = _SHARD_NAME_RE.match(key[len(prefix):]) if key.startswith(prefix) else None
        if m is None or m.group("ext") != SHARD_EXT[kind]:
            raise ManifestError(f"{what}.key {key!r} is not a {kind} shard key under {prefix}")
        if key in keys:
            raise ManifestError(f"{what}.key {key!r} appears twice")
        keys.add(key)
        if s["format"] != SHARD_FORMATS[kind]:
            raise ManifestError(f"{what}.format must be {SHARD_FORMATS[kind]!r} in a {kind} version")
        shards.append(ShardEntry(key, _int(s["size"], f"{what}.size", 1, MAX_SHARD_BYTES),
                                 _str(s["sha256"], f"{what}.sha256", _HEX64, 64), s["format"]))

    raw_tensors = doc["tensors"]
    if not isinstance(raw_tensors, list) or not 1 <= len(raw_tensors) <= MAX_TENSORS:
        raise ManifestError(f"tensors must be a list of 1..{MAX_TENSORS} entries")
    tensors, names, spans = [], set(), {}
    for i, t in enumerate(raw_tensors):
        what = f"tensors[{i}]"
        _members(t, what, ("name", "dtype", "shape", "shard", "offset", "length", "checksum"))
        name = _str(t["name"], f"{what}.name")
        if name in names:
            raise ManifestError(f"{what}.name {name!r} appears twice")
        names.add(name)
        if t["dtype"] not in DTYPE_SIZES:
            raise ManifestError(f"{what}.dtype {t['dtype']!r:.40} is not one of {sorted(DTYPE_SIZES)}")
        shape = t["shape"]
        if not isinstance(shape, list) or len(shape) > MAX_NDIM:
            raise ManifestError(f"{what}.shape must be a list of at most {MAX_NDIM} dimensions")
        shape = tuple(_int(d, f"{what}.shape", 0, MAX_DIM) for d in shape)
        shard = _int(t["shard"], f"{what}.shard", 0, len(shards) - 1)
        offset = _int(t["offset"], f"{what}.offset", 0, MAX_SHARD_BYTES)
        length = _int(t["length"], f"{what}.length", 0, MAX_SHARD_BYTES)
        if offset + length > shards[shard].size:
            raise ManifestError(f"{what} range [{offset}, {offset + length}) exceeds shard {shard} "
                                f"({shards[shard].size} bytes)")
        checksum = int(_str(t["checksum"], f"{what}.checksum", _HEX16, 16), 16)
        entry = TensorEntry(name, t["dtype"], shape, shard, offset, length, checksum)
        if entry.numel > MAX_DIM:
            raise ManifestError(f"{what}.shape {shape} has too many elements")
        if kind == "full" and length != entry.nbytes:
            raise ManifestError(f"{what}: {length} bytes for a {t['dtype']} tensor of shape {list(shape)} "
                                f"({entry.nbytes} expected)")
        if kind == "delta" and length == 0:
            raise ManifestError(f"{what}: a delta tensor needs a non-empty blob")
        spans.setdefault(shard, []).append((offset, offset + length, name))
        tensors.append(entry)
    for shard, ranges in spans.items():
        ranges.sort()
        for (_, end_a, a), (start_b, _, b) in zip(ranges, ranges[1:]):
            if start_b < end_a:
                raise ManifestError(f"tensors {a!r} and {b!r} overlap in shard {shard}")
    return Manifest(run_id, version, kind, base, base_digest, step, created_at, session,
                    tuple(tensors), tuple(shards))
