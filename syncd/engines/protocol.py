"""The one protocol every engine implements: :class:`Adapter` (weight updates) and :class:`Generator`
(serving); and :class:`EngineLink`, what the node daemon holds for each engine it drives, in this process or
another. The daemon (``syncd.daemon``), the Dynamo worker (``syncd.engine.dynamo``) and the tests talk to engines
only through these.

Update lifecycle, driven by one controller thread (the daemon) while other threads keep serving::

    stage(update)   # any time, while serving; may take seconds (decoding, pinning); never pauses serving
    pause()         # returns once no forward pass is running; requests and KV caches are kept
    apply()         # writes the staged update in place; only the changed words move
    checksum()      # controller verifies; on mismatch it calls rollback() (or loads a full version)
    resume()        # every in-flight request continues on the new weights

Contract:

* ``stage``/``pause``/``apply``/``rollback``/``resume``/``load_full`` are called from one controller thread
  at a time, in that order; they are not re-entrant. ``generate`` and ``abort`` are thread-safe and may be
  called from any thread (or event loop) at any time, including while paused: new requests queue until
  ``resume``.
* ``pause`` blocks at most for one forward step of the running batch (tens of ms on the reference
  engine); ``apply`` and ``rollback`` block for the in-place write; ``resume`` returns at once.
* ``apply`` raises ``syncd.errors.DeltaError`` if a staged delta does not fit the engine's current weights;
  the engine's weights are then exactly as before the call (every parameter, not only the failed one).
  ``rollback`` after a successful ``apply`` restores the previous version's weights bit for bit.
* ``version`` is the weight version every token generated from now on is sampled with; it changes only in
  ``apply``/``rollback``/``load_full``, all while paused.
* An :class:`~syncd.engines.update.Update` is in memory or names a version in the node cache
  (:meth:`Update.from_cache <syncd.engines.update.Update.from_cache>`); an engine in this process reads its
  ``tensors`` (decoded from the cache on first use), an engine in another process is sent the reference
  and reads the shards itself. Every engine takes an update from the node cache; only an engine in this
  process can take one held in memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator, Protocol, Sequence, runtime_checkable

from syncd.engines.params import ParamSpec
from syncd.engines.update import Update

__all__ = ["Adapter", "EngineLink", "SamplingParams", "GenerationRequest", "TokenEvent", "Generator"]


@runtime_checkable
class Adapter(Protocol):
    """Weight-update side of an engine (see the module docstring for the threading contract)."""

    @property
    def version(self) -> int | None:
        """Current weight version (``None`` before any weights were loaded)."""

    def parameters(self) -> Sequence[ParamSpec]:
        """The engine's local parameters and how they map to the trainer's tensors."""

    def stage(self, update: Update) -> None:
        """Prepare ``update`` in CPU memory (pinned when the engine is on a GPU) while serving. Replaces a
        previously staged, unapplied update. Raises ``DeltaError`` for a blob that is malformed or names
        an unknown tensor, and ``ValueError`` for a ``base_version`` other than ``version``."""

    def pause(self) -> None:
        """Return once no forward pass is running; keep every request and its KV cache."""

    def apply(self) -> None:
        """Write the staged update in place (paused only); all or nothing (see module docstring)."""

    def rollback(self) -> None:
        """Undo the last ``apply`` bit for bit (paused only). Raises ``RuntimeError`` if there is none."""

    def load_full(self, update: Update) -> None:
        """Replace every weight with a full version (paused only), e.g. to rebuild after a restart."""

    def resume(self) -> None:
        """Continue serving; in-flight requests go on with the new weights."""

    def checksum(self, names: Sequence[str] | None = None) -> dict[str, int]:
        """``syncd.ops.checksum`` of local parameters by local name (all when ``names`` is None)."""


@runtime_checkable
class EngineLink(Adapter, Protocol):
    """An :class:`Adapter` as the node daemon drives it, with the engine's control state: one kind of link
    for every engine, in this process (:class:`~syncd.engines.local.InProcessLink`) or another
    (:class:`~syncd.engines.client.RemoteAdapter`, over the control routes of :mod:`syncd.engines.wire`).

    ``state()`` is ``{"run_id", "version", "writes", "instance", "lease"}`` (wire form of the ``version``
    route); ``lease()`` takes or renews this controller's lease and returns the state (raises
    :class:`~syncd.errors.LeaseHeld` while another controller holds it); ``release()`` gives it back.
    ``last_writes`` is the engine's write counter right after this link's last write (None before one);
    ``url`` says where the engine is, for status pages. Raises
    :class:`~syncd.engines.errors.EngineUnreachable` when the engine does not answer."""

    url: str
    last_writes: int | None

    def state(self) -> dict:
        """The engine's control state (no lease taken)."""

    def lease(self) -> dict:
        """Take or renew this controller's lease; the engine's control state."""

    def release(self) -> None:
        """Give the lease back (a later controller need not wait for it to expire)."""


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. ``temperature == 0`` is greedy; ``top_k == 0`` and ``top_p == 1`` disable those
    filters. The same ``seed``, prompt and weights give the same tokens."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class GenerationRequest:
    """``prompt_token_ids`` may already hold tokens generated earlier (a migrated request): generation
    continues after them, and ``sampling.max_tokens`` counts only new tokens."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()


@dataclass(frozen=True)
class TokenEvent:
    """One generated token. ``index`` counts generated tokens of the request from 0; ``finish_reason`` is
    ``"stop"`` / ``"length"`` / ``"abort"`` on the last event and ``None`` before."""

    request_id: str
    index: int
    token_id: int
    logprob: float
    version: int | None
    finish_reason: str | None = None


@runtime_checkable
class Generator(Protocol):
    """Serving side of an engine."""

    def generate(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        """Async iterator of the request's tokens (thread-safe; usable from any event loop)."""

    def abort(self, request_id: str) -> None:
        """Stop a request; its stream ends with ``finish_reason="abort"``. Unknown ids are ignored."""
