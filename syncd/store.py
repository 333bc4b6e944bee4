"""One thin layer over obstore for every backend syncd talks to: ``file://``, ``memory://``, ``s3://``,
``gs://`` and ``az://``. No other storage client is used anywhere in syncd.

:class:`Store` adds what the rest of syncd needs on top of obstore:

* parallel multipart upload of large objects (``put``) and parallel ranged download (``download``),
* retries with exponential backoff and jitter: obstore retries HTTP requests itself (5xx, dropped
  connections, timeouts; configured by :class:`RetryPolicy`), and ``Store`` retries a whole operation that
  still failed with a transient error,
* create-if-absent puts (``put(..., create=True)``, S3 and Azure ``If-None-Match: *``, GCS generation 0, an
  atomic hard link on local disk) that stay correct when a retried attempt finds its own earlier write,
* conditional GET for cheap polling (``get_if_changed``),
* errors mapped to :mod:`syncd.errors` (``ObjectNotFound``, ``ObjectExists``, ``StoreError``), each naming
  the store and the key.

Keys are ``/``-separated relative paths. A ``Store`` is thread-safe and may be shared.

Where the store is (see :func:`resolve_url`): an explicit URL or path, else ``SYNCD_STORE``, else the
embedded default ``file://$XDG_DATA_HOME/syncd/store`` (``~/.local/share/syncd/store``). S3 endpoint,
region and credentials come from the usual ``AWS_*`` variables (read by obstore) unless given as
``endpoint=`` / ``options=``; GCS and Azure read ``GOOGLE_*`` / ``AZURE_*`` the same way.

``endpoint=`` (``--endpoint``, ``SYNCD_STORE_ENDPOINT``) points a cloud store elsewhere, e.g. at an emulator:
for ``s3://`` the S3 endpoint (path-style requests), for ``gs://`` the GCS base URL (obstore's ``base_url``),
for ``az://`` the account URL (obstore's ``endpoint``; Azurite: ``http://127.0.0.1:10000/devstoreaccount1``
with options ``account_name`` / ``access_key``). ``http://`` allows plain HTTP. An emulator still needs
credentials for obstore: GCS any ``bearer_token`` (else obstore asks the cloud metadata server for one).
``docs/layout.md`` ("Stores") has the emulators the tests use and what each lacks.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from urllib.parse import urlsplit
from urllib.request import url2pathname

import obstore
from obstore import exceptions as obx
from obstore.store import LocalStore, MemoryStore, from_url

from syncd.errors import IntegrityError, ObjectExists, ObjectNotFound, ObjectTooLarge, StoreError

log = logging.getLogger(__name__)

ENV_STORE = "SYNCD_STORE"
ENV_ENDPOINT = "SYNCD_STORE_ENDPOINT"
_AWS_ENDPOINT_VARS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT")

DEFAULT_PART_BYTES = 16 << 20
DEFAULT_CONCURRENCY = 8
MIN_UPLOAD_PART = 5 << 20  # S3's minimum multipart part size

_MEMORY: dict[str, MemoryStore] = {}
_MEMORY_LOCK = threading.Lock()

#: errors worth another attempt; everything else (not found, exists, precondition, auth, bad path,
#: bad configuration) is final.
_TRANSIENT = (obx.GenericError, ConnectionError, TimeoutError)


def default_url() -> str:
    """The embedded default store: ``file://`` under ``$XDG_DATA_HOME`` (or ``~/.local/share``)/syncd/store."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base, "syncd", "store").resolve().as_uri()


def resolve_url(url: str | os.PathLike | None = None) -> str:
    """The store URL to use: ``url``, else ``$SYNCD_STORE``, else :func:`default_url`.

    A plain filesystem path (absolute or relative) becomes a ``file://`` URL of its absolute path."""
    if url is None or url == "":
        url = os.environ.get(ENV_STORE) or default_url()
    url = os.fspath(url)
    if "://" not in url:
        return Path(url).expanduser().resolve().as_uri()
    return url


@dataclass(frozen=True)
class RetryPolicy:
    """Retries: ``http_retries`` per HTTP request inside obstore (backoff ``initial_backoff_s`` doubling up
    to ``max_backoff_s``, total ``retry_timeout_s``), then ``attempts`` tries of the whole operation."""

    attempts: int = 3
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 15.0
    http_retries: int = 10
    retry_timeout_s: float = 180.0

    def obstore_config(self) -> dict:
        return {
            "max_retries": self.http_retries,
            "retry_timeout": timedelta(seconds=self.retry_timeout_s),
            "backoff": {"init_backoff": timedelta(seconds=self.initial_backoff_s),
                        "max_backoff": timedelta(seconds=self.max_backoff_s), "base": 2},
        }

    def delay(self, attempt: int) -> float:
        """Full-jitter backoff before retry number ``attempt`` (1-based), in seconds."""
        return random.uniform(0, min(self.max_backoff_s, self.initial_backoff_s * 2 ** attempt))


@dataclass(frozen=True)
class ObjectInfo:
    """Metadata of one object: ``key`` relative to the store root, ``size`` in bytes, the store's
    ``etag`` (opaque, may be None) and ``last_modified`` (timezone-aware UTC)."""

    key: str
    size: int
    etag: str | None
    last_modified: datetime


def _info(meta) -> ObjectInfo:
    return ObjectInfo(meta["path"], int(meta["size"]), meta.get("e_tag"), meta["last_modified"])


class Store:
    """A connection to one object store location. See the module docstring for the contract.

    ``url``: store URL or path (None: :func:`resolve_url`); or pass an obstore store object.
    ``endpoint``: where a cloud store is (see the module docstring: the S3 endpoint, the GCS base URL or the
    Azure account URL), overriding ``SYNCD_STORE_ENDPOINT`` (and, for S3, ``AWS_ENDPOINT_URL``); ``http://``
    endpoints are allowed. ``options``: extra obstore configuration for the backend (e.g.
    ``region``, ``conditional_put``). ``part_bytes``: part size of multipart uploads and ranged downloads.
    ``concurrency``: parallel parts per object. ``create``: make a local store's directory if it is missing
    (False: a missing directory is a ``ValueError``, for read-only tools where it is likely a typo).
    """

    def __init__(self, url: str | os.PathLike | None = None, *, endpoint: str | None = None,
                 options: dict | None = None, retry: RetryPolicy | None = None,
                 part_bytes: int = DEFAULT_PART_BYTES, concurrency: int = DEFAULT_CONCURRENCY,
                 create: bool = True, _raw=None):
        if part_bytes < 1 << 16:
            raise ValueError("part_bytes must be at least 64 KiB")
        self.retry = retry or RetryPolicy()
        self.part_bytes = int(part_bytes)
        self.concurrency = max(1, int(concurrency))
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        if _raw is not None:
            self.raw, self.url = _raw, f"obstore:{type(_raw).__name__}"
            return
        self.url = resolve_url(url)
        self.raw = self._connect(self.url, endpoint, dict(options or {}), create)

    @classmethod
    def open(cls, store: "Store | str | os.PathLike | None" = None, **kwargs) -> "Store":
        """``store`` if it already is a :class:`Store`, else a new one for that URL/path/obstore object."""
        if isinstance(store, Store):
            return store
        if isinstance(store, (LocalStore, MemoryStore)) or type(store).__module__.startswith("obstore"):
            return cls(_raw=store, **kwargs)
        return cls(store, **kwargs)

    def _connect(self, url: str, endpoint: str | None, options: dict, create: bool):
        scheme = urlsplit(url).scheme.lower()
        try:
            if scheme == "file":
                path = Path(url2pathname(urlsplit(url).path))
                if create:
                    path.mkdir(parents=True, exist_ok=True)
                elif not path.is_dir():
                    raise ValueError(f"store {url}: {path} {'is not a directory' if path.exists() else 'does not exist'}"
                                     f" (readers never create a store; check --store / {ENV_STORE})")
                return LocalStore(path, automatic_cleanup=True)
            if scheme == "memory":
                with _MEMORY_LOCK:
                    return _MEMORY.setdefault(url.rstrip("/"), MemoryStore())
            if scheme not in ("s3", "s3a", "gs", "az", "abfs", "abfss", "azure", "adl"):
                raise ValueError(f"unsupported store URL scheme {scheme!r} in {url!r} "
                                 "(use file://, memory://, s3://, gs:// or az://)")
            client = {"timeout": timedelta(seconds=120), "connect_timeout": timedelta(seconds=10)}
            endpoint = endpoint or os.environ.get(ENV_ENDPOINT) or next(
                (os.environ[v] for v in _AWS_ENDPOINT_VARS if os.environ.get(v) and scheme in ("s3", "s3a")), None)
            if endpoint:
                check_endpoint(endpoint)
                if endpoint.startswith("http://"):
                    client["allow_http"] = True
                if scheme in ("s3", "s3a"):
                    options.setdefault("endpoint", endpoint)
                    options.setdefault("virtual_hosted_style_request", False)
                else:
                    options.setdefault("base_url" if scheme == "gs" else "endpoint", endpoint)
            return from_url(url, client_options=client, retry_config=self.retry.obstore_config(), **options)
        except obx.BaseError as exc:
            raise ValueError(f"cannot open store {url!r}: {exc}") from None

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    # ------------------------------------------------------------------------------------- plumbing

    def _run(self, what: str, key: str, fn, *args, **kwargs):
        """Call ``fn`` with whole-operation retries on transient errors; map obstore errors."""
        attempt = 0
        while True:
            try:
                return fn(*args, **kwargs)
            except (FileNotFoundError, obx.NotFoundError):
                raise ObjectNotFound(f"{self.url}: {key} does not exist") from None
            except obx.AlreadyExistsError:
                raise ObjectExists(f"{self.url}: {key} already exists") from None
            except (obx.PermissionDeniedError, obx.UnauthenticatedError) as exc:
                raise StoreError(f"{self.url}: {what} {key}: access denied: {_short(exc)}") from exc
            except _TRANSIENT as exc:
                attempt += 1
                if attempt >= self.retry.attempts:
                    raise StoreError(f"{self.url}: {what} {key} failed after {attempt} attempts: "
                                     f"{_short(exc)}") from exc
                delay = self.retry.delay(attempt)
                log.warning("%s: %s %s failed (%s); retry %d in %.2fs", self.url, what, key, _short(exc),
                            attempt, delay)
                time.sleep(delay)
            except obx.BaseError as exc:
                raise StoreError(f"{self.url}: {what} {key}: {_short(exc)}") from exc

    def _executor(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="syncd-store")
            return self._pool

    def close(self) -> None:
        """Stop the download thread pool (the store stays usable; a pool is made again on demand)."""
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    # ------------------------------------------------------------------------------------- writes

    def put(self, key: str, data, *, create: bool = False) -> str | None:
        """Write ``data`` (bytes-like) at ``key`` atomically: readers see all of it or none.

        ``create=True``: only if no object is there, else :class:`ObjectExists` and nothing is written.
        If an attempt failed transiently and a retry then finds an object with exactly our bytes, that is
        our own earlier write and counts as success. Objects over ``part_bytes`` (and ``create=False``)
        go up as a parallel multipart upload in parts of ``max(part_bytes, 5 MiB)``. Returns the new
        object's etag where the store gives one.
        """
        data = memoryview(data).cast("B")
        chunk = max(self.part_bytes, MIN_UPLOAD_PART)
        multipart = not create and len(data) > chunk
        tried = [0]

        def attempt():
            tried[0] += 1
            try:
                return obstore.put(self.raw, key, data, mode="create" if create else "overwrite",
                                   use_multipart=multipart, chunk_size=chunk,
                                   max_concurrency=self.concurrency)
            except obx.AlreadyExistsError:
                if tried[0] > 1 and self._same_content(key, data):
                    log.info("%s: create of %s was retried and found its own first write", self.url, key)
                    return {"e_tag": None}
                raise

        return self._run("put", key, attempt).get("e_tag")

    def _same_content(self, key: str, data: memoryview) -> bool:
        try:
            return bytes(obstore.get(self.raw, key).bytes()) == data
        except (obx.BaseError, FileNotFoundError):
            return False

    def delete(self, keys) -> None:
        """Delete ``keys`` (a key or an iterable); keys that are already gone are not an error."""
        keys = [keys] if isinstance(keys, str) else list(keys)
        for i in range(0, len(keys), 1000):
            batch = keys[i:i + 1000]
            try:
                self._run("delete", batch[0], obstore.delete, self.raw, batch)
            except ObjectNotFound:  # the local store refuses a batch with a missing key: go one by one
                for key in batch:
                    try:
                        self._run("delete", key, obstore.delete, self.raw, key)
                    except ObjectNotFound:
                        pass

    # ------------------------------------------------------------------------------------- reads

    def get(self, key: str, *, limit: int | None = None) -> bytes:
        """The object at ``key`` -- or, with ``limit``, at most its first ``limit`` bytes, so that a caller
        can bound the memory a hostile object costs. :class:`ObjectNotFound` if there is none."""
        if limit is None:
            return bytes(self._run("get", key, lambda: obstore.get(self.raw, key).bytes()))
        return bytes(self._run("get", key, self._prefix, key, limit)[1])

    def get_bounded(self, key: str, max_bytes: int) -> bytes:
        """The object at ``key`` if it has at most ``max_bytes``; else :class:`ObjectTooLarge`, after one
        ranged GET whose body is not read (a hostile huge object costs a request, not its size).
        :class:`ObjectNotFound` if there is none."""
        def fetch():
            try:
                r = obstore.get(self.raw, key, options={"range": (0, max_bytes + 1)})
            except obx.GenericError:
                if int(obstore.head(self.raw, key)["size"]) == 0:
                    return 0, b""
                raise
            size = int(r.meta["size"])
            return size, (None if size > max_bytes else bytes(r.bytes()))

        size, data = self._run("get", key, fetch)
        if data is None:
            raise ObjectTooLarge(f"{self.url}: {key} is {size} bytes, over the {max_bytes}-byte limit; not read")
        return data

    def _prefix(self, key: str, n: int):
        """``(object size, its first n bytes)`` in one ranged GET (a HEAD as well for an empty object,
        where stores refuse the range)."""
        try:
            r = obstore.get(self.raw, key, options={"range": (0, n)})
        except obx.GenericError:
            if int(obstore.head(self.raw, key)["size"]) == 0:
                return 0, b""
            raise
        return int(r.meta["size"]), r.bytes()

    def get_if_changed(self, key: str, etag: str | None, *, limit: int | None = None
                       ) -> tuple[bytes, str | None] | None:
        """Conditional GET: None if the object's etag is still ``etag``, else ``(content, new_etag)``.

        The cheap way to poll a small object that changes rarely. With ``limit``, at most the first
        ``limit`` bytes are read (a hostile object costs no more). :class:`ObjectNotFound` if absent."""
        def fetch():
            options = {"if_none_match": etag} if etag else {}
            if limit is not None:
                options["range"] = (0, limit)
            try:
                r = obstore.get(self.raw, key, options=options or None)
            except obx.NotModifiedError:
                return None
            except obx.GenericError:
                if limit is not None and int(obstore.head(self.raw, key)["size"]) == 0:
                    return b"", None  # stores refuse a range of an empty object
                raise
            return bytes(r.bytes()), r.meta.get("e_tag")

        return self._run("get", key, fetch)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the object (fewer if it ends sooner)."""
        return bytes(self._run("get range of", key, obstore.get_range, self.raw, key, start=start, end=end))

    def download(self, key: str, *, expect_size: int | None = None) -> bytearray:
        """The whole object, fetched as up to ``concurrency`` parallel ranged reads of ``part_bytes``.

        The first request also learns the size, so a small object costs one round trip. With
        ``expect_size``, an object of another size raises :class:`IntegrityError` after that first part,
        before any memory is allocated for the rest."""
        def first():
            return self._prefix(key, self.part_bytes)

        size, head = self._run("get", key, first)
        if expect_size is not None and size != expect_size:
            raise IntegrityError(f"{self.url}: {key} is {size} bytes, expected {expect_size}")
        out = bytearray(size)
        view = memoryview(out)
        view[: len(head)] = head

        def part(start):
            end = min(start + self.part_bytes, size)
            chunk = self._run("get range of", key, obstore.get_range, self.raw, key, start=start, end=end)
            if len(chunk) != end - start:
                raise StoreError(f"{self.url}: {key} changed while it was read ({len(chunk)} bytes at "
                                 f"{start}, expected {end - start})")
            view[start:end] = chunk

        futures = [self._executor().submit(part, s) for s in range(len(head), size, self.part_bytes)]
        for f in futures:
            f.result()
        return out

    def head(self, key: str) -> ObjectInfo:
        """Metadata of the object at ``key``; :class:`ObjectNotFound` if there is none."""
        return _info(self._run("head", key, obstore.head, self.raw, key))

    def exists(self, key: str) -> bool:
        try:
            self.head(key)
            return True
        except ObjectNotFound:
            return False

    def list(self, prefix: str) -> list[ObjectInfo]:
        """Every object whose key starts with ``prefix`` (a directory prefix should end in '/')."""
        def collect():
            out = []
            for batch in obstore.list(self.raw, prefix.rstrip("/") + "/" if prefix else None):
                out.extend(_info(m) for m in batch)
            return out

        try:
            return self._run("list", prefix, collect)
        except ObjectNotFound:
            return []

    def list_dirs(self, prefix: str) -> list[str]:
        """Names of the immediate sub-directories under ``prefix`` (without the prefix or trailing '/')."""
        prefix = prefix.rstrip("/") + "/"
        try:
            res = self._run("list", prefix, obstore.list_with_delimiter, self.raw, prefix)
        except ObjectNotFound:
            return []
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in res["common_prefixes"])


def check_endpoint(endpoint: str) -> str:
    """``endpoint`` if it is an ``http://`` or ``https://`` URL with a host, else ``ValueError`` naming the
    flag and the variables it may come from (obstore would otherwise fail deep inside with a panic)."""
    u = urlsplit(endpoint)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(f"store endpoint {endpoint!r} (--endpoint, {ENV_ENDPOINT} or, for S3, "
                         f"{'/'.join(_AWS_ENDPOINT_VARS)}) must be a URL with a scheme, e.g. http://127.0.0.1:9000 "
                         "or https://s3.example.com")
    return endpoint


def _short(exc: BaseException) -> str:
    """First line of an obstore error (they append multi-line debug dumps)."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def open_store(store=None, **kwargs) -> Store:
    """Alias of :meth:`Store.open`: accept a :class:`Store`, a URL, a path, an obstore store, or None."""
    return Store.open(store, **kwargs)
