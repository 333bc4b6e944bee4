"""Reading weight versions back from the store: the one bounded manifest read and the one chain walk, list,
latest, verify, materialize (retention: :mod:`syncd.retention`).

Everything read from the store is hostile until checked. The order is always: manifest bytes → strict parse
→ signature (when a key is configured) → schema → "is it where it claims to be" → shard size and SHA-256 →
codec header (dtype, shape, base and result checksums against the manifests) → apply → result checksum.
Any failure raises a named :mod:`syncd.errors` exception *before* its data is used; ``materialize`` never
returns partially built weights.

Signing keys: every function takes ``signing_key`` (None: ``SYNCD_SIGNING_KEY`` / ``SYNCD_SIGNING_KEY_FILE``,
``SYNCD_VERIFY_KEYS`` and ``SYNCD_ALLOW_UNSIGNED``; False: no key; :data:`~syncd.signing.UNCHECKED`: no key,
read signed manifests unchecked; or a key object of :mod:`syncd.signing`, public keys being enough). Without
a key, signed manifests are refused (:class:`SignatureError` naming the variables) unless ``UNCHECKED``; a
warning is logged once per process.

Thread-safety: functions are reentrant; they share nothing but the :class:`~syncd.store.Store` (thread-safe).
"""

from __future__ import annotations

import hashlib
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from syncd import manifest as mf
from syncd.errors import (BaseVersionMissing, DeltaError, IntegrityError, ManifestError, ManifestMismatch,
                          ObjectNotFound, ObjectTooLarge, SyncdError, VersionNotFound)
from syncd.newest import VersionPoller
from syncd.signing import ENV_KEY, ENV_KEY_FILE, ENV_VERIFY_KEYS, UNCHECKED, resolve_policy
from syncd.store import Store

log = logging.getLogger(__name__)
_warned_unsigned = False

__all__ = ["latest_version", "poll_latest", "refuse_unchecked", "materialize", "read_manifest", "read_manifest_bytes",
           "resolve_chain", "walk_back", "check_link", "list_versions", "verify_run", "fetch_shard", "fetch_shards",
           "cache_version", "load_full", "apply_delta", "VersionInfo"]


def _resolve(signing_key):
    """``signing_key`` resolved once (environment read, key parsed) into a value every function here takes:
    a key object of :mod:`syncd.signing`, ``False`` (no key: signed manifests refused) or
    :data:`~syncd.signing.UNCHECKED` (no key, signed manifests read unchecked). Warns once per process
    when nothing is checked."""
    global _warned_unsigned
    key, allow_unsigned = resolve_policy(signing_key)
    if key is None and not _warned_unsigned:
        _warned_unsigned = True
        log.warning("no signing key configured (%s, %s or %s): manifest signatures are NOT verified%s",
                    ENV_VERIFY_KEYS, ENV_KEY, ENV_KEY_FILE, "" if allow_unsigned else "; signed manifests are refused")
    return key if key is not None else (UNCHECKED if allow_unsigned else False)


# ---------------------------------------------------------------------------------------------- manifests


def read_manifest_bytes(store, run_id: str, version: int) -> bytes:
    """The stored bytes of ``version``'s manifest, unverified (the one bounded read every reader uses: a
    manifest over :data:`~syncd.manifest.MAX_MANIFEST_BYTES` is refused after one ranged GET, unread).
    Raises :class:`VersionNotFound` if it has none, :class:`ManifestError` if it is too large,
    :class:`~syncd.errors.StoreError` if the store cannot be read."""
    k = mf.manifest_key(run_id, version)
    try:
        return store.get_bounded(k, mf.MAX_MANIFEST_BYTES)
    except ObjectNotFound:
        raise VersionNotFound(f"run {run_id!r} has no version {version} in {store.url}") from None
    except ObjectTooLarge as exc:
        raise ManifestError(f"manifest of version {version}: {exc}") from None


def read_manifest(store, run_id: str, version: int, *, signing_key=None) -> mf.Manifest:
    """The verified manifest of ``version``. Raises :class:`VersionNotFound` if it has none, and
    :class:`ManifestError` / :class:`SignatureError` / :class:`ManifestMismatch` if it is not acceptable."""
    return _read_verified(Store.open(store, create=False), run_id, version, signing_key)[0]


def _read_verified(store: Store, run_id: str, version: int, signing_key) -> tuple[mf.Manifest, bytes]:
    """``read_manifest``'s manifest with the very bytes it was parsed from."""
    raw = read_manifest_bytes(store, run_id, version)
    key = _resolve(signing_key)
    return mf.parse(raw, key=None if key is UNCHECKED or key is False else key, run_id=run_id, version=version,
                    where=f"{store.url}/{mf.manifest_key(run_id, version)}", allow_unsigned=key is UNCHECKED), raw


def latest_version(store, run_id: str, *, signing_key=None) -> int | None:
    """Newest *valid* version of ``run_id`` (its manifest read, parsed and, with a key, verified), or None
    if the run has none. The store listing is the source of truth (the ``latest.json`` hint is not used);
    directories without a manifest (an upload in progress, or torn by a crash) and versions whose manifest
    is unusable are skipped, the latter logged as a warning. Raises :class:`~syncd.errors.StoreError`."""
    return _newest_valid(Store.open(store, create=False), run_id, _resolve(signing_key))[0]


def has_versions(store, run_id: str) -> bool:
    """Whether the run has any version directory at all (valid, torn or invalid): one LIST, nothing read or
    verified. What a trainer asks before it starts a run at version 0. Raises
    :class:`~syncd.errors.StoreError`."""
    store = Store.open(store, create=False)
    vp = mf.versions_prefix(run_id)
    return any(mf.parse_version_dir(o.key[len(vp):].split("/", 1)[0]) is not None for o in store.list(vp))


def _newest_valid(store: Store, run_id: str, signing_key) -> tuple[int | None, list]:
    """``(newest valid version or None, [(version, error) of the unusable ones above it]``, each logged)."""
    skipped = []

    def skip(v, exc):
        skipped.append((v, exc))
        log.warning("run %s: version %d skipped: %s: %s", run_id, v, type(exc).__name__, exc)

    poller = VersionPoller(store, run_id, read=lambda v: read_manifest(store, run_id, v, signing_key=signing_key),
                           max_reads=1 << 30, on_skip=skip)
    return poller.walk_listing(), skipped


def poll_latest(store, run_id: str, etag: str | None = None, *, signing_key=None):
    """Cheap polling for a new version: a conditional GET of the run's ``latest.json`` hint.

    Returns None while the hint is unchanged since ``etag`` (one request, no body). Otherwise returns
    ``(version, new_etag)``, where ``version`` is the newest valid version (:class:`syncd.newest.VersionPoller`:
    the hinted one once its manifest verifies and the ones after it probed, else the listing walked from the
    top; unusable versions skipped and logged), None while the run has none. Stateless: each call reads an
    unusable version again; a long-running poller keeps a :class:`~syncd.newest.VersionPoller`.
    Raises :class:`~syncd.errors.StoreError`."""
    store = Store.open(store, create=False)
    signing_key = _resolve(signing_key)
    poller = VersionPoller(store, run_id, read=lambda v: read_manifest(store, run_id, v, signing_key=signing_key),
                           list_every_s=float("inf"), etag=etag, list_first=etag is None)
    v = poller.poll()
    return None if poller.unchanged else (v, poller.etag)


def refuse_unchecked(store, run_id: str, signing_key=None) -> None:
    """Secure by default, at start: raise ``ValueError`` (a configuration error, naming ``SYNCD_SIGNING_KEY``
    and ``SYNCD_SIGNING_KEY_FILE``) when no key is configured, ``--allow-unsigned`` was not given, and the
    run's newest manifest is signed -- a reader that forgot its key must not start as if the run were
    unsigned. Reads one listing and one manifest; a run without versions passes."""
    from syncd.signing import NO_KEY_HELP

    store = Store.open(store, create=False)
    if _resolve(signing_key) is not False:
        return
    versions = (mf.parse_version_dir(d) for d in store.list_dirs(mf.versions_prefix(run_id)))
    for v in sorted((v for v in versions if v is not None), reverse=True):
        try:
            raw = read_manifest_bytes(store, run_id, v)
        except (VersionNotFound, ManifestError):
            continue
        key_id = mf.signature_key_id(raw)
        if key_id is not None:
            raise ValueError(f"run {run_id!r} in {store.url} holds signed manifests (version {v}: key id "
                             f"{key_id!r}) but no signing key is configured; refusing to start: {NO_KEY_HELP}")
        return


def walk_back(get, version: int, *, check=None):
    """The one chain walk: yield ``version``'s manifest, then each base down to the newest full version at or
    below it. ``get(v) -> Manifest`` reads a verified manifest (raising what it raises: a missing base propagates
    after the manifests above it were yielded); ``check(base, child)`` vets each delta against its base before
    the base is yielded (e.g. :func:`check_link`; None: no check)."""
    m = get(version)
    yield m
    while m.kind == "delta":
        base = get(m.base_version)
        if check is not None:
            check(base, m)
        yield base
        m = base


def resolve_chain(store, run_id: str, version: int | None = None, *, signing_key=None) -> list[mf.Manifest]:
    """Verified manifests from the newest full version at or before ``version`` to ``version`` itself
    (None: the latest). Raises :class:`VersionNotFound` if ``version`` does not exist,
    :class:`BaseVersionMissing` if a base in its chain is gone, :class:`ManifestMismatch` if a delta's
    recorded base digest or tensor list does not match its base."""
    store = Store.open(store, create=False)
    signing_key = _resolve(signing_key)
    if version is None:
        version, skipped = _newest_valid(store, run_id, signing_key)
        if version is None and skipped:
            raise skipped[0][1]  # the newest unusable one says best what is wrong
        if version is None:
            raise VersionNotFound(f"run {run_id!r} has no versions in {store.url}")
    chain = []
    try:
        for m in walk_back(lambda v: read_manifest(store, run_id, v, signing_key=signing_key), version,
                           check=check_link):
            chain.append(m)
    except VersionNotFound:
        if not chain:
            raise
        raise BaseVersionMissing(
            f"run {run_id!r} version {version} cannot be materialized: delta version {chain[-1].version} "
            f"needs base version {chain[-1].base_version}, which is not in {store.url}") from None
    return chain[::-1]


def check_link(base: mf.Manifest, child: mf.Manifest) -> None:
    """Raise :class:`ManifestMismatch` unless ``child`` was made against exactly ``base`` (manifest digest)."""
    if base.digest != child.base_digest:
        raise ManifestMismatch(f"version {child.version} was made against a different version "
                               f"{base.version} (base manifest digest {child.base_digest[:16]}..., "
                               f"found {base.digest[:16]}...)")
    theirs = [(t.name, t.dtype, t.shape) for t in child.tensors]
    ours = [(t.name, t.dtype, t.shape) for t in base.tensors]
    if theirs != ours:
        raise ManifestMismatch(f"delta version {child.version} names other tensors than its base "
                               f"version {base.version}")


# ---------------------------------------------------------------------------------------------- shards


def fetch_shard(store: Store, run_id: str, m: mf.Manifest, s: mf.ShardEntry) -> bytearray:
    """Download one shard of ``m`` and check its size and SHA-256 against the manifest.

    Raises :class:`IntegrityError` naming the shard on a mismatch, :class:`VersionNotFound` if it is gone.
    Thread-safe (``Store`` is)."""
    key = mf.run_prefix(run_id) + s.key
    try:
        data = store.download(key, expect_size=s.size)
    except ObjectNotFound:
        raise VersionNotFound(f"{store.url}/{key}, a shard of version {m.version}, is gone "
                              "(deleted by retention while it was read, or removed)") from None
    except IntegrityError as exc:
        raise IntegrityError(f"shard of version {m.version} does not match its manifest: {exc}") from None
    got = hashlib.sha256(data).hexdigest()
    if got != s.sha256:
        raise IntegrityError(f"{store.url}/{key}: SHA-256 {got[:16]}... does not match the manifest of "
                             f"version {m.version} ({s.sha256[:16]}...): the shard was altered")
    return data


def fetch_shards(store, run_id: str, m: mf.Manifest, *, threads: int = 4) -> list[bytearray]:
    """Download every shard of ``m`` in parallel, each checked as by :func:`fetch_shard`."""
    store = Store.open(store, create=False)

    def one(s: mf.ShardEntry) -> bytearray:
        return fetch_shard(store, run_id, m, s)

    if len(m.shards) == 1:
        return [one(m.shards[0])]
    with ThreadPoolExecutor(min(threads, len(m.shards)), thread_name_prefix="syncd-fetch") as pool:
        return list(pool.map(one, m.shards))


def cache_version(store, run_id: str, version: int, cache, *, signing_key=None) -> bytes:
    """Put ``version``'s shards, verified, into the node cache ``cache`` (a :class:`syncd.cache.ShardCache`), as a
    node daemon would before an engine loads the version from it; returns the manifest's bytes (what the engine is
    handed with the cache's folder: the bytes that were verified, read once)."""
    store = Store.open(store, create=False)
    m, raw = _read_verified(store, run_id, version, signing_key)
    for s, data in zip(m.shards, fetch_shards(store, run_id, m)):
        cache.put(s.sha256, data)
    return bytes(raw)


def load_full(m: mf.Manifest, shards: list, *, device="cpu") -> dict:
    """Tensors of a full version from its verified shards; every tensor's checksum is checked.

    Each returned tensor owns its memory (nothing aliases ``shards``). Raises :class:`IntegrityError`."""
    import torch

    from syncd.ops import checksum

    out = {}
    for t in m.tensors:
        view = memoryview(shards[t.shard])[t.offset:t.offset + t.length]
        dtype = getattr(torch, t.dtype)
        tensor = torch.empty(t.shape, dtype=dtype)
        if t.length:
            tensor.view(-1).view(torch.uint8).copy_(torch.frombuffer(view, dtype=torch.uint8))
        got = checksum(tensor)
        if got != t.checksum:
            raise IntegrityError(f"version {m.version} tensor {t.name!r}: checksum {got:016x}, manifest "
                                 f"says {t.checksum:016x}")
        out[t.name] = tensor.to(device) if str(device) != "cpu" else tensor
    return out


def apply_delta(weights: dict, base: mf.Manifest, m: mf.Manifest, shards: list, *, backend="auto") -> None:
    """Apply delta version ``m`` to ``weights`` (the tensors of version ``base``) in place.

    All-or-nothing: before anything is written, ``m`` must chain to ``base``, every tensor must be present
    with the manifest's dtype and shape and have ``base``'s checksum, and every blob's header must agree with
    both manifests (dtype, shape, base and result checksums). A failure raises :class:`ManifestMismatch` or
    :class:`IntegrityError` with ``weights`` untouched. Each tensor is then applied by the codec with its
    own base and result check, which cannot fail after the checks above short of a codec fault.
    """
    from syncd.ops import checksum, delta

    check_link(base, m)
    base_ck = {t.name: t.checksum for t in base.tensors}
    blobs = []
    for t in m.tensors:
        w = weights.get(t.name)
        if w is None or str(w.dtype).removeprefix("torch.") != t.dtype or tuple(w.shape) != t.shape:
            raise ManifestMismatch(f"version {m.version}: tensor {t.name!r} ({t.dtype}{list(t.shape)}) does not "
                                   "match the weights it is applied to")
        blob = memoryview(shards[t.shard])[t.offset:t.offset + t.length]
        try:
            info = delta.inspect(blob)
        except DeltaError as exc:
            raise IntegrityError(f"version {m.version} tensor {t.name!r}: bad delta blob: {exc}") from None
        if (str(info["dtype"]).removeprefix("torch.") != t.dtype or tuple(info["shape"]) != t.shape
                or info["base_checksum"] != base_ck[t.name] or info["new_checksum"] != t.checksum):
            raise IntegrityError(f"version {m.version} tensor {t.name!r}: delta blob does not match the "
                                 "manifests (dtype, shape or checksums)")
        have = checksum(w, backend=backend)
        if have != base_ck[t.name]:
            raise IntegrityError(f"version {m.version} applies to version {base.version}, but tensor {t.name!r} "
                                 f"has checksum {have:016x}, not version {base.version}'s {base_ck[t.name]:016x}")
        blobs.append((t, w, blob))
    try:
        delta.apply_many([w for _, w, _ in blobs], [b for _, _, b in blobs], backend=backend)
    except DeltaError as exc:
        raise IntegrityError(f"version {m.version} (weights now partly updated): {exc}") from None


def materialize(store, run_id: str, version: int | None = None, *, signing_key=None, device="cpu",
                backend="auto") -> dict:
    """The weights of ``version`` (None: the latest) of ``run_id``, as ``{name: tensor}`` in manifest order.

    Built from the newest full version at or before it plus the delta chain after it, verifying every
    manifest, shard hash and tensor checksum on the way. ``store`` is a URL/path or a :class:`Store`.
    Raises :class:`VersionNotFound`, :class:`BaseVersionMissing`, :class:`ManifestError` (and its
    subclasses :class:`SignatureError`, :class:`ManifestMismatch`), :class:`IntegrityError`, or
    :class:`~syncd.errors.StoreError`; on any error nothing is returned.
    """
    store = Store.open(store, create=False)
    chain = resolve_chain(store, run_id, version, signing_key=signing_key)
    weights = load_full(chain[0], fetch_shards(store, run_id, chain[0]), device=device)
    for base, m in zip(chain, chain[1:]):
        apply_delta(weights, base, m, fetch_shards(store, run_id, m), backend=backend)
    log.info("materialized run %s version %d from full version %d + %d deltas", run_id, chain[-1].version,
             chain[0].version, len(chain) - 1)
    return weights


# ---------------------------------------------------------------------------------------------- listing


@dataclass
class VersionInfo:
    """One version directory: ``manifest`` when it verified, else ``error`` (None + "torn": no manifest)."""

    version: int
    manifest: mf.Manifest | None = None
    error: str | None = None
    objects: list = field(default_factory=list)

    @property
    def status(self) -> str:
        return "ok" if self.manifest is not None else ("torn" if self.error is None else "invalid")


def list_versions(store, run_id: str, *, signing_key=None) -> list[VersionInfo]:
    """Every version directory of the run, oldest first, each with its verified manifest or the reason it
    has none. One LIST plus one GET per manifest; never raises for a bad manifest (it is reported)."""
    store = Store.open(store, create=False)
    key = _resolve(signing_key)
    by_version: dict[int, list] = {}
    vp = mf.versions_prefix(run_id)
    for obj in store.list(vp):
        v = mf.parse_version_dir(obj.key[len(vp):].split("/", 1)[0])
        if v is not None:
            by_version.setdefault(v, []).append(obj)
    out = []
    for v in sorted(by_version):
        info = VersionInfo(v, objects=by_version[v])
        if any(o.key == mf.manifest_key(run_id, v) for o in info.objects):
            try:
                info.manifest = read_manifest(store, run_id, v, signing_key=key)
            except (ManifestError, VersionNotFound) as exc:
                info.error = f"{type(exc).__name__}: {exc}"
        out.append(info)
    return out


def verify_run(store, run_id: str, *, signing_key=None, deep: bool = True, backend="auto"):
    """Check every version of the run; yields ``(version, status, message)`` oldest first, ``status`` one
    of ``"ok"``, ``"failed"`` (the version is unusable; ``message`` says why) or ``"torn"`` (a directory
    without a manifest: an upload in progress or the leftovers of a crash; not a version, not an error).

    Shallow (``deep=False``): manifests, and that every shard exists with its recorded size. Deep: also
    downloads everything, checks hashes, and rebuilds every version (walking the chain once, so the cost is
    one full load per full version plus one apply per delta) comparing all tensor checksums."""
    store = Store.open(store, create=False)
    signing_key = _resolve(signing_key)
    infos = list_versions(store, run_id, signing_key=signing_key)
    prefix = mf.run_prefix(run_id)
    weights, current = None, None
    for info in infos:
        if info.manifest is None:
            if info.error:
                yield info.version, "failed", info.error
            else:
                yield info.version, "torn", "no manifest: an upload in progress, or left over by a crash"
            continue
        m = info.manifest
        try:
            sizes = {o.key: o.size for o in info.objects}
            for s in m.shards:
                if sizes.get(prefix + s.key) != s.size:
                    raise IntegrityError(f"shard {s.key} is missing or has the wrong size")
            if deep:
                if m.kind == "full":
                    weights = load_full(m, fetch_shards(store, run_id, m))
                elif current is not None and current.version == m.base_version and weights is not None:
                    apply_delta(weights, current, m, fetch_shards(store, run_id, m), backend=backend)
                else:
                    weights = materialize(store, run_id, m.version, signing_key=signing_key, backend=backend)
            current = m
            yield m.version, "ok", f"{m.kind}, {len(m.tensors)} tensors, {m.total_bytes} bytes, {m.signature_text}"
        except SyncdError as exc:
            weights, current = None, None
            yield m.version, "failed", f"{type(exc).__name__}: {exc}"

