"""Finding the newest *valid* version of a run: the one poll every reader uses (``syncd.versions``, the node
daemon's poller, the cluster controller).

"Newest" means the highest version whose manifest has been read, parsed and (with a key) verified -- never a
high-water mark of object names. A store may hold anything: a forged ``latest.json`` (garbage, deeply
nested, huge, pointing far into the future or back in time), garbage or replayed manifests at any version
number, unsigned ones in a signed run. :class:`VersionPoller` treats all of it as hostile:

* the hint is read with a conditional GET of at most :data:`~syncd.manifest.MAX_HINT_BYTES` and parsed by
  :func:`syncd.jsonsafe.loads` (size, depth, no floats); a bad hint only means "list instead";
* a hinted version is taken only once its manifest verifies; the versions after it are probed (the hint may
  lag), each verified, at most ``max_probe`` of them before the listing takes over;
* the listing (every ``list_every_s``, and whenever the hint is missing, bad or points at an unusable version)
  is walked from the top down, reading at most ``max_reads`` manifests per poll; an unusable version is
  skipped, reported (``on_skip``) and not read again for ``retry_s``, a directory without a manifest well above
  the newest known version (more than ``max_probe`` above: not where the next versions appear) is not read
  again by a listing for ``list_every_s``; a walk cut short by the budget goes on at the next poll, so a
  thousand garbage or empty directories above the real versions cost a few polls, not a stall;
* ``probe_next``: every poll also probes the versions after the newest one known (up to ``max_probe``), so new
  versions are found under a stale or forged hint without waiting for a listing (the cluster controller).

A bad hint is logged once per content (``on_bad_hint(exc)`` is called for each new one), however often it
is rewritten.

``read(version) -> Manifest`` does the reading and verifying (the daemon passes its
:class:`~syncd.manifest_source.ManifestSource`; :func:`syncd.versions.poll_latest` a stateless reader); it
raises :class:`~syncd.errors.VersionNotFound` for a version without a manifest (torn: not reported),
a :class:`~syncd.errors.SyncdError` for an unusable one, and :class:`~syncd.errors.StoreError` when the store
cannot be read (propagated: the caller backs off). Not thread-safe: one poller per polling task.
"""

from __future__ import annotations

import logging
import time

from syncd import manifest as mf
from syncd import jsonsafe
from syncd.errors import ObjectNotFound, StoreError, SyncdError, VersionNotFound
from syncd.jsonsafe import JSONError

log = logging.getLogger(__name__)


def parse_hint(body: bytes, where: str) -> int:
    """The version a ``latest.json`` hint names; :class:`~syncd.jsonsafe.JSONError` if it is not a small
    JSON object with an integer ``version`` in range."""
    doc = jsonsafe.loads(body, what=where, max_bytes=mf.MAX_HINT_BYTES, max_depth=2, floats=False)
    v = doc.get("version") if isinstance(doc, dict) else None
    try:
        mf.version_dir(v)
    except ValueError as exc:
        raise JSONError(f"{where}: not a hint ({{\"version\": V, ...}}): {exc}") from None
    return v


class VersionPoller:
    """See the module docstring. :meth:`poll` returns the newest valid version found (or None)."""

    def __init__(self, store, run_id: str, *, read, list_every_s: float = 30.0, max_reads: int = 16,
                 max_probe: int = 8, retry_s: float = 60.0, on_skip=None, etag: str | None = None,
                 list_first: bool = True, probe_next: bool = False, on_bad_hint=None):
        self.store, self.run_id, self.read = store, mf.check_run_id(run_id), read
        self.list_every_s, self.max_reads, self.max_probe, self.retry_s = list_every_s, max_reads, max_probe, retry_s
        self.on_skip, self.on_bad_hint, self.probe_next = on_skip, on_bad_hint, probe_next
        self.etag = etag
        self._bad_hint: bytes | None = None  # the last unusable hint's content (reported once)
        self._missing: dict[int, float] = {}  # listed version without a manifest -> when (monotonic)
        self.newest: int | None = None
        self.listed_empty = False  # the last listing found no version directory at all
        self._bad: dict[int, float] = {}  # unusable version -> when it may be read again (monotonic)
        self.unchanged = False  # the last poll found the hint unchanged and listed nothing
        self._last_list = float("-inf") if list_first else time.monotonic()
        self._unfinished = False  # the last walk ran out of budget

    def poll(self) -> int | None:
        """One poll (blocking): the newest valid version now known (None: none yet), or None as well when
        the hint is unchanged and no listing is due. Raises :class:`StoreError` if the store fails."""
        force_list = self._unfinished or time.monotonic() - self._last_list >= self.list_every_s
        try:
            got = self.store.get_if_changed(mf.latest_hint_key(self.run_id), self.etag, limit=mf.MAX_HINT_BYTES + 1)
        except ObjectNotFound:
            got, force_list, self.etag = None, True, None
        found = None
        if got is not None:
            body, self.etag = got
            try:
                found = self._walk_up(parse_hint(body, f"{self.store.url}/{mf.latest_hint_key(self.run_id)}"))
            except JSONError as exc:
                self._hint_unusable(body, exc)
            if found is None:
                force_list = True
            elif not force_list:
                self._last_list = time.monotonic()  # probing past the hint did what a listing would
        if force_list:
            self._last_list = time.monotonic()
            listed = self.walk_listing()
            if listed is not None and (found is None or listed > found):
                found = listed
        probed = False
        if self.probe_next and self.newest is not None and (found is None or found <= self.newest):
            nxt = self._probe_after(self.newest)
            if nxt > self.newest:
                found, probed = nxt, True
        if found is not None and (self.newest is None or found > self.newest):
            self.newest = found
        self.unchanged = got is None and not force_list and not probed
        return None if self.unchanged else self.newest

    # ------------------------------------------------------------------------------------- internals

    def _usable(self, v: int) -> bool | None:
        """True if version ``v`` verifies, False if it is unusable (reported), None if it has no manifest."""
        if self._bad.get(v, 0.0) > time.monotonic():
            return False
        try:
            self.read(v)
        except VersionNotFound:
            return None
        except StoreError:
            raise
        except SyncdError as exc:
            self._bad[v] = time.monotonic() + self.retry_s
            if len(self._bad) > 4096:  # a store full of garbage must not grow memory without bound
                self._bad.pop(min(self._bad, key=self._bad.get))
            if self.on_skip is not None:
                self.on_skip(v, exc)
            else:
                log.warning("run %s: version %d skipped: %s: %s", self.run_id, v, type(exc).__name__, exc)
            return False
        self._bad.pop(v, None)
        return True

    def _hint_unusable(self, body: bytes, exc: JSONError) -> None:
        if body == self._bad_hint:
            return  # reported once per content, however often it is rewritten
        self._bad_hint = bytes(body)
        log.warning("run %s: the latest.json hint is unusable (%s); listing versions instead", self.run_id,
                    str(exc)[:200])
        if self.on_bad_hint is not None:
            self.on_bad_hint(exc)

    def _probe_after(self, v: int) -> int:
        """The newest valid version reached from valid version ``v`` by probing ``v + 1``, ``v + 2``, ... (at
        most ``max_probe``; ``v`` itself when the next one is missing or unusable)."""
        for _ in range(self.max_probe):
            nxt = v + 1
            if nxt > mf.MAX_VERSION or not self.store.exists(mf.manifest_key(self.run_id, nxt)):
                return v
            if not self._usable(nxt):
                return v
            v = nxt
        return v

    def _walk_up(self, hinted: int) -> int | None:
        """The newest valid version at or after ``hinted`` by probing; None if ``hinted`` is unusable or
        the probe budget ran out (the listing decides then)."""
        if not self._usable(hinted):
            return None
        v = self._probe_after(hinted)
        return None if v - hinted >= self.max_probe else v

    def walk_listing(self) -> int | None:
        """The newest valid version in the listing, reading at most ``max_reads`` manifests (the rest of
        the walk continues at the next :meth:`poll`); None if none was found within the budget."""
        dirs = self.store.list_dirs(mf.versions_prefix(self.run_id))
        versions = sorted((v for v in map(mf.parse_version_dir, dirs) if v is not None), reverse=True)
        self.listed_empty = not versions
        self._unfinished = False
        now = time.monotonic()
        self._missing = {v: t for v, t in self._missing.items() if now - t < self.list_every_s}
        reads = 0
        near = (-1 if self.newest is None else self.newest) + self.max_probe  # where the next versions appear
        for v in versions:
            if self.newest is not None and v <= self.newest:
                return self.newest  # known valid already; nothing below it matters
            if self._bad.get(v, 0.0) > now or (v > near and v in self._missing):
                continue
            if reads >= self.max_reads:
                self._unfinished = True
                return None
            reads += 1
            usable = self._usable(v)
            if usable:
                return v
            if usable is None:  # a directory without a manifest (an upload in progress, or torn)
                self._missing[v] = now
                if len(self._missing) > 4096:
                    self._missing.pop(min(self._missing, key=self._missing.get))
        return None
