"""One engine as the daemon sees it, and the update sequence that must never leave it on wrong weights.

``apply_staged`` is the critical section (blocking; the daemon runs it in a worker thread and never
interrupts it): ``pause`` -> ``apply`` -> checksum check against the manifest -> ``resume``.

* ``apply`` fails (the Adapter contract: weights unchanged): the weights are checked against the previous
  version; if they match, the engine resumes on it and :class:`UpdateFailed` is raised, else it stays
  paused and :class:`NeedsRebuild` is raised.
* The checksums after ``apply`` differ from the manifest's: ``rollback``, check against the previous
  version, resume on it and raise :class:`UpdateFailed`; if rollback fails or does not restore it, the
  engine stays paused and :class:`NeedsRebuild` is raised.

So an engine resumes only on weights whose checksums equal a verified manifest's. Versions are applied in
order and at most once (a step whose base is not the engine's version, or a version it already passed, is
refused with ``RuntimeError``).
"""

from __future__ import annotations

import logging
import time

from syncd import manifest as mf
from syncd.daemon import testhooks

log = logging.getLogger(__name__)


class UpdateFailed(RuntimeError):
    """An update was not applied; the engine serves its previous, verified version."""


class NeedsRebuild(RuntimeError):
    """The engine's weights match no known version; it is paused until rebuilt."""


class EngineDriver:
    """State and update sequences of one engine (``adapter``: any ``engine.Adapter``; remote ones are
    ``engine.control.RemoteAdapter``). Not thread-safe: the daemon drives one engine from one task."""

    def __init__(self, name: str, adapter, *, metrics=None):
        self.name, self.adapter, self.metrics = name, adapter, metrics
        self.version: int | None = None  # the last version verified on the engine
        self.verified = False
        self.needs_rebuild = False
        self.reachable = True
        self.paused = False
        self.state = "unknown"
        self.error: str | None = None
        self.applied: set[int] = set()  # versions applied since the last rebuild: never twice
        self.retry_at = 0.0
        self.failures = 0
        self._specs = None

    @property
    def remote(self) -> bool:
        from engine.control import RemoteAdapter

        return isinstance(self.adapter, RemoteAdapter)

    def forget_specs(self) -> None:
        self._specs = None

    def expected(self, m: mf.Manifest) -> dict[str, int]:
        """Checksums the engine's parameters must have at version ``m``, by local name (parameters that
        are slices or fusions of trainer tensors are not in a manifest and are left out)."""
        from engine.updater import expected_checksums

        if self._specs is None:
            self._specs = list(self.adapter.parameters())
        exp = expected_checksums(self._specs, {t.name: t.checksum for t in m.tensors})
        if not exp:
            raise RuntimeError(f"engine {self.name}: none of its parameters maps 1:1 to a trainer tensor; "
                               "its weights cannot be checked against a manifest")
        return exp

    def mismatches(self, m: mf.Manifest) -> list[str]:
        """Local parameters whose checksum differs from version ``m``'s (empty: the weights are ``m``)."""
        exp = self.expected(m)
        got = self.adapter.checksum(list(exp))
        return [n for n, ck in exp.items() if got.get(n) != ck]

    def _pause(self) -> None:
        self.adapter.pause()
        self.paused = True

    def resume(self) -> None:
        self.adapter.resume()
        self.paused = False

    def apply_staged(self, m: mf.Manifest, prev: mf.Manifest | None) -> dict:
        """The critical section for a staged version ``m`` (``prev``: the engine's current version's
        manifest). Returns ``{"pause_s", "apply_s", "check_s"}``; raises as the module docstring says."""
        if m.version in self.applied or (self.version is not None and m.version <= self.version):
            raise RuntimeError(f"engine {self.name}: version {m.version} was already applied (engine at "
                               f"{self.version}); refusing to apply it again")
        if m.kind == "delta" and m.base_version != self.version:
            raise RuntimeError(f"engine {self.name}: delta {m.version} applies to {m.base_version}, engine is at "
                               f"{self.version}")
        t0 = time.perf_counter()
        self._pause()
        try:
            self.adapter.apply()
        except Exception as exc:
            self._count("apply")
            self._restore_or_rebuild(prev, f"apply of version {m.version} failed: {type(exc).__name__}: {exc}")
        t1 = time.perf_counter()
        testhooks.reached("apply", m.version)
        t2 = time.perf_counter()
        bad = self.mismatches(m)
        t3 = time.perf_counter()
        if bad:
            self._count("checksum")
            why = (f"after applying version {m.version}, {len(bad)} parameter(s) do not match its checksums "
                   f"(first: {bad[0]})")
            try:
                self.adapter.rollback()
            except Exception as exc:  # noqa: BLE001 -- any failure here means: rebuild
                log.error("engine %s: rollback failed: %s", self.name, exc)
                prev = None
            self._restore_or_rebuild(prev, why)
        self.version = m.version
        self.applied.add(m.version)
        self.resume()
        t4 = time.perf_counter()
        return {"pause_s": t4 - t0 - (t2 - t1), "apply_s": t1 - t0, "check_s": t3 - t2}

    def _restore_or_rebuild(self, prev: mf.Manifest | None, why: str):
        """After a failed update, while paused: resume on ``prev`` if the weights are exactly it."""
        try:
            ok = prev is not None and not self.mismatches(prev)
        except Exception as exc:  # noqa: BLE001
            log.error("engine %s: cannot check its weights: %s", self.name, exc)
            ok = False
        if ok:
            self.resume()
            raise UpdateFailed(f"engine {self.name}: {why}; it serves version {prev.version} again")
        self.verified, self.needs_rebuild = False, True
        raise NeedsRebuild(f"engine {self.name}: {why}; its weights match no version, it stays paused "
                           "until rebuilt")

    def _count(self, kind: str) -> None:
        if self.metrics is not None:
            self.metrics.failure(kind)
