"""One engine as the daemon sees it, and the update sequence that must never leave it on wrong weights.

``apply_staged`` is the critical section (blocking; the daemon runs it in a worker thread and never
interrupts it): ``pause`` -> ``apply`` -> checksum check against the manifest -> ``resume``.

* ``apply`` fails (the Adapter contract: weights unchanged): the weights are checked against the previous
  version; if they match, the engine resumes on it and :class:`UpdateFailed` is raised, else it stays
  paused and :class:`NeedsRebuild` is raised.
* The checksums after ``apply`` differ from the manifest's: ``rollback``, check against the previous
  version, resume on it and raise :class:`UpdateFailed`; if rollback fails or does not restore it, the
  engine stays paused and :class:`NeedsRebuild` is raised.

``rebuild`` is the other critical section: an engine whose weights are unknown (new to the daemon and not
matching its reported version, restarted with its initial weights, another run's, or left matching no version
by a failed update) is loaded with the newest full version and the delta chain after it, all while paused,
from the node cache (the daemon's shard source fills it first). It resumes only once its checksums equal a
manifest's: the chain's last version's, or, when it refuses to stage a delta of the chain (which writes
nothing: a blob it cannot decode, such as a format-2 delta of a tensor it holds only in slices, or a bad
cached shard), the version it reached before it, which it then serves. On any other failure it stays
paused and :class:`RebuildFailed` is raised (it must not serve weights that match no version).

So an engine resumes only on weights whose checksums equal a verified manifest's. Versions are applied in
order and at most once (a step whose base is not the engine's version, or a version it already passed, is
refused with ``RuntimeError``).
"""

from __future__ import annotations

import logging
import time

from syncd import manifest as mf
from syncd.daemon import points
from syncd.engines.errors import EngineUnreachable
from syncd.engines.params import expected_checksums  # loads torch with the daemon, never inside an engine's pause
from syncd.engines.update import Update

log = logging.getLogger(__name__)


class UpdateFailed(RuntimeError):
    """An update was not applied; the engine serves its previous, verified version."""


class NeedsRebuild(RuntimeError):
    """The engine's weights match no known version; it is paused until rebuilt."""


class RebuildFailed(RuntimeError):
    """A rebuild did not reach verified weights; the engine stays paused."""


class EngineDriver:
    """State and update sequences of one engine (``adapter``: its :class:`~syncd.engines.protocol.EngineLink`,
    in this process or another, driven alike). Not thread-safe: the daemon drives one engine from one task
    (its blocking methods, :meth:`refresh` and the critical sections :meth:`apply_staged` and :meth:`rebuild`,
    in a worker thread, one at a time); the fields below are read and set by that task between calls.

    ``known``: ``(instance, writes)`` of the engine's control state right after this daemon's last write
    or check. Only the lease holder can write, so a change the daemon did not make means its lease lapsed
    and someone else wrote, or the engine restarted: its weights must be checked again."""

    def __init__(self, name: str, adapter, *, metrics=None):
        self.name, self.adapter, self.metrics = name, adapter, metrics
        self.known: tuple | None = None
        self._scrub_at = 0  # index into the sorted parameter names where the next scrub starts
        self._scrub_due = 0.0  # time.monotonic() from which the next engine check scrubs
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

    def forget_specs(self) -> None:
        self._specs = None

    def expected(self, m: mf.Manifest) -> dict[str, int]:
        """Checksums the engine's parameters must have at version ``m``, by local name (parameters that
        are slices or fusions of trainer tensors are not in a manifest and are left out)."""
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

    def probe(self) -> dict:
        """The engine's control state ``{"run_id", "version", "writes", "instance"}``, renewing this
        daemon's lease. Raises ``LeaseHeld`` or ``EngineUnreachable``."""
        return self.adapter.lease()

    def release(self) -> None:
        """Give the engine's lease back (the daemon stops); never raises."""
        try:
            self.adapter.release()
        except Exception as exc:  # noqa: BLE001 -- it expires by itself anyway
            log.info("engine %s: lease not released (%s); it expires on its own", self.name, exc)

    def settle(self) -> None:
        """Record the control state after this daemon's own write (see ``known``): the write counter as
        this daemon's last write left it (so a write someone slipped in since, while the lease had lapsed
        during a long call, still shows), the instance as the engine reports it now."""
        st = self.probe()
        writes = self.adapter.last_writes
        self.known = (st["instance"], st["writes"] if writes is None else writes)

    def scrub(self, m: mf.Manifest, budget_bytes: int) -> list[str]:
        """Checksum the next ``budget_bytes`` of local parameters (round robin; at least one) against
        version ``m``; returns those that differ. Catches writes outside the control routes (memory
        corruption, an engine bug) over ``total / budget`` checks without reading every weight each time."""
        exp = self.expected(m)
        sizes = {s.name: _nbytes(s) for s in self._specs}
        names = sorted(exp)
        picked, used = [], 0
        for i in range(len(names)):
            n = names[(self._scrub_at + i) % len(names)]
            if picked and used + sizes.get(n, 0) > budget_bytes:
                break
            picked.append(n)
            used += sizes.get(n, 0)
        self._scrub_at = (self._scrub_at + len(picked)) % len(names)
        got = self.adapter.checksum(picked)
        return [n for n in picked if got.get(n) != exp[n]]

    def refresh(self, manifests, *, run_id: str, scrub_bytes: int, scrub_every_s: float = 0.0) -> None:
        """Blocking, once per engine check: renew the lease and read the engine's state; verify its weights
        when they are new to this daemon, were written by someone else, or are another run's; otherwise scrub
        ``scrub_bytes`` of them once ``scrub_every_s`` seconds have passed since the last scrub ended (0: every
        check). Leaves ``state``/``error`` saying what was found; never raises for the engine's sake (a store
        error reading a manifest propagates)."""
        from syncd.errors import LeaseHeld, ManifestError, StoreError, VersionNotFound

        try:
            st = self.probe()
        except LeaseHeld as exc:
            if self.state != "held by another controller":
                log.error("engine %s: %s; not touching it", self.name, exc)
                self._count("lease")
            self.verified, self.known, self.state, self.error = False, None, "held by another controller", str(exc)
            return
        except (EngineUnreachable, OSError) as exc:
            if self.reachable:
                log.warning("engine %s is unreachable: %s", self.name, exc)
                self._count("engine")
            self.reachable, self.verified, self.state, self.error = False, False, "unreachable", str(exc)
            self.forget_specs()
            return
        except Exception as exc:  # noqa: BLE001 -- an engine answering nonsense must not stop the others
            if self.state != "error":
                log.error("engine %s: its state cannot be read: %s: %s", self.name, type(exc).__name__, exc)
                self._count("engine")
            self.verified, self.known, self.state, self.error = False, None, "error", f"{type(exc).__name__}: {exc}"
            return
        v, seen = st["version"], (st["instance"], st["writes"])
        if not self.reachable:
            log.info("engine %s answers again (version %s)", self.name, v)
        self.reachable = True
        restarted = self.known is not None and seen[0] != self.known[0]
        foreign = self.known is not None and not restarted and seen != self.known
        other_run = st["run_id"] is not None and st["run_id"] != run_id
        if (self.verified and v == self.version and not self.needs_rebuild and not foreign and not restarted
                and not other_run):
            if scrub_bytes > 0 and v is not None and time.monotonic() >= self._scrub_due:
                try:
                    bad = self.scrub(manifests.get(v), scrub_bytes)
                finally:
                    self._scrub_due = time.monotonic() + scrub_every_s
                if bad:
                    log.error("engine %s: %d parameter(s) no longer match version %d (first: %s): its weights "
                              "changed behind the daemon's back; rebuilding", self.name, len(bad), v, bad[0])
                    self._count("unexpected_write")
                    self.version, self.verified, self.needs_rebuild, self.state = None, False, True, "needs rebuild"
                    self.error = f"weights changed outside the daemon ({len(bad)} parameters, first {bad[0]})"
                    return
            if self.state in ("unknown", "unreachable", "held by another controller"):
                self.state, self.error = "serving", None
            return
        if foreign:
            log.error("engine %s: its weights were written by someone else (instance/writes %s -> %s): checking "
                      "them", self.name, self.known, seen)
            self._count("unexpected_write")
        elif self.verified or self.version is not None:
            log.warning("engine %s reports version %s, expected %s (restarted?): checking its weights", self.name,
                        v, self.version)
        self.verified, self.known = False, None
        if v is None or other_run:
            if other_run:
                log.warning("engine %s holds run %r's weights (version %s): rebuilding it for run %s", self.name,
                            st["run_id"], v, run_id)
            self.version, self.needs_rebuild, self.state = None, True, "needs rebuild"
            return
        try:
            ok = not self.mismatches(manifests.get(v))
        except (VersionNotFound, ManifestError) as exc:
            log.warning("engine %s holds version %d, which cannot be verified (%s): rebuilding", self.name, v, exc)
            ok = False
        except StoreError as exc:
            log.warning("engine %s: cannot read version %d's manifest now: %s", self.name, v, exc)
            return
        if ok:
            self.version, self.verified, self.needs_rebuild, self.state, self.error = v, True, False, "serving", None
            self.applied = {v}
            self.resume()  # a daemon that died mid-update may have left it paused on these (verified) weights
            self.known = seen
            log.info("engine %s verified at version %d", self.name, v)
        else:
            self.version, self.needs_rebuild, self.state = None, True, "needs rebuild"

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
        points.reached("apply", m.version)
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
        self.settle()
        return {"pause_s": t4 - t0 - (t2 - t1), "apply_s": t1 - t0, "check_s": t3 - t2}

    def rebuild(self, plan, raws: list[bytes], cache_root) -> dict:
        """The critical section of a rebuild (blocking): load ``plan.steps[0]`` (a full version) and apply the
        deltas after it (``raws``: each step's manifest bytes; the shards in the node cache at ``cache_root``),
        all while paused; verify; resume. Returns ``{"pause_s", "version", "refused"}``: the version the engine
        now serves, and None, or, when it refused to stage a delta of the chain, what it said (it then serves
        the version before that delta). Raises :class:`RebuildFailed` (engine left paused), ``ValueError`` if
        the plan does not start from a full version; an error of the engine's control calls after the checks
        (resume, lease) propagates as it is."""
        if not plan.from_full:
            raise ValueError("a rebuild starts from a full version")
        t0 = time.perf_counter()
        self._pause()
        reached, refused = 0, None  # the index in plan.steps of what the engine holds
        try:
            self.adapter.load_full(Update.from_cache(plan.steps[0], cache_root, raw=raws[0]))
            for i, (m, raw) in enumerate(zip(plan.steps[1:], raws[1:]), 1):
                try:
                    self.adapter.stage(Update.from_cache(m, cache_root, raw=raw))
                except Exception as exc:  # noqa: BLE001 -- nothing was written: the engine holds steps[reached]
                    refused = f"staging {m.version}: {type(exc).__name__}: {exc}"
                    break
                self.adapter.apply()
                reached = i
            bad = self.mismatches(plan.steps[reached])
        except Exception as exc:
            self.verified, self.needs_rebuild = False, True
            raise RebuildFailed(f"engine {self.name}: rebuilding version {plan.target} from full version "
                                f"{plan.steps[0].version} failed: {type(exc).__name__}: {exc}") from exc
        version = plan.steps[reached].version
        if bad:
            self.verified, self.needs_rebuild = False, True
            raise RebuildFailed(f"engine {self.name}: rebuilt version {version}, but {len(bad)} parameter(s) "
                                f"do not match its checksums (first: {bad[0]})")
        self.version, self.verified, self.needs_rebuild = version, True, False
        self.applied = set(plan.versions[:reached + 1])
        self.resume()
        self.settle()
        if refused:
            log.error("engine %s rebuilt only up to version %d (full %d + %d deltas), which it serves: %s",
                      self.name, version, plan.steps[0].version, reached, refused)
        else:
            log.info("engine %s rebuilt at version %d (full %d + %d deltas) in %.3fs", self.name, version,
                     plan.steps[0].version, reached, time.perf_counter() - t0)
        return {"pause_s": time.perf_counter() - t0, "version": version, "refused": refused}

    def _restore_or_rebuild(self, prev: mf.Manifest | None, why: str):
        """After a failed update, while paused: resume on ``prev`` if the weights are exactly it."""
        try:
            ok = prev is not None and not self.mismatches(prev)
        except Exception as exc:  # noqa: BLE001
            log.error("engine %s: cannot check its weights: %s", self.name, exc)
            ok = False
        if ok:
            self.resume()
            self.settle()
            raise UpdateFailed(f"engine {self.name}: {why}; it serves version {prev.version} again")
        self.verified, self.needs_rebuild = False, True
        raise NeedsRebuild(f"engine {self.name}: {why}; its weights match no version, it stays paused "
                           "until rebuilt")

    def _count(self, kind: str) -> None:
        if self.metrics is not None:
            self.metrics.failure(kind)


def _nbytes(spec) -> int:
    n = spec.dtype.itemsize
    for d in spec.shape:
        n *= d
    return n
