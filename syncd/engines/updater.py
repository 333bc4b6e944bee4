"""``WeightUpdater``: the weight-update half of ``syncd.engines.Adapter`` over a set of local tensors, for any engine.

An engine describes its local parameters with :class:`~syncd.engines.params.ParamSpec` (renamed, fused and
tensor-parallel sliced ones included) and hands over the live tensors, and optionally a hook for written
parameters (``written``, as checkpoint-engine's ``post_hook``); the updater implements ``stage``, ``apply``,
``rollback``, ``load_full``, ``checksum`` and ``version`` on them. The engine keeps the serving side
(``pause``/``resume``) and calls the updater while paused; :class:`~syncd.engines.in_place.InPlaceAdapter` puts the
two together into the whole Adapter.

How an update moves (``docs/engine.md``):

* ``stage(update)`` does all the work that can run while serving. Every delta blob is parsed and validated
  (``syncd.ops.delta.changes``; a format-2 blob's context blocks against the engine's own copy of the old tensor,
  which it must hold whole: a tensor-parallel slice cannot decode them, ``DeltaError``); positions of the full
  trainer tensor are mapped to local flat positions (dropped when another rank owns them); the current bits at those
  positions (the *old* words) are read and the new words computed. For a parameter that maps 1:1 to a trainer tensor
  ``syncd.ops.delta.changed_words`` also checks the blob's base checksum against the local tensor (one read pass)
  and the result checksum against the trainer's (from the changed words: no copy of the tensor, no second decode).
  A full version is compared with the local weights and only the words that differ are staged. The result is, per
  local parameter, ascending positions plus the old and new words, in CPU memory: about 12 bytes per changed bf16
  word (int64 positions). For a parameter on a GPU they are pinned, positions are int32 where they fit and the old
  words get a fingerprint (:func:`fingerprint`), so an apply sends 6 bytes per changed bf16 word over PCIe.
* ``apply()`` scatters the new words; each staged position must still hold its staged old word, checked
  just before it is written (CPU: one pass on every core, ``syncd.ops.scatter_words_``). Only
  changed words move. If anything fails, every word already written is restored from the old words and the
  error is raised: all or nothing.
* ``rollback()`` scatters the old words of the last apply back: bit-exact and as cheap as the apply.
* ``load_full(update)`` validates everything first (names, dtypes, shapes, checksums) and then copies.
* After each write the engine's ``written`` hook refreshes what the engine computes from the written words
  (dequantized or packed copies); if it fails after an apply, the apply is undone and the hook runs again for
  the old words, so an apply stays all or nothing for the weights and what is computed from them.

Local tensors may be any view that flattens without a copy (``t.view(-1)`` works), for example the bf16
words inside an fp32 tensor that holds bf16-exact values (:func:`bf16_view_of_fp32`), so an engine can
compute in fp32 while the trainer's bf16 words are updated in place. How local parameters map onto the
trainer's tensors (validation, position mapping, building and checksumming local tensors) is part of the
engine contract, :mod:`syncd.engines.params`; what a staged update is, :mod:`syncd.engines.staging`.

Thread-safety: ``stage``/``apply``/``rollback``/``load_full`` follow the Adapter contract (one controller
thread; ``apply``/``rollback``/``load_full`` only while the engine runs no forward pass). ``stage`` and
``checksum`` only read the weights and may run while the engine serves. Errors: ``DeltaError`` for a blob
that is malformed, names an unknown tensor, or does not fit; ``IntegrityError`` for a full tensor whose
checksum differs from the update's; ``ValueError`` for a ``base_version`` other than ``version``;
``RuntimeError`` for calls out of order (apply with nothing staged, rollback with nothing applied).
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np
import torch

from syncd.engines.params import (ParamPiece, ParamSpec, build_local, check_like, check_spec, expected_checksums,
                                  flat_view, local_slab, map_positions, slab, word_view)
from syncd.engines.staging import StagedParam, StagedUpdate, fingerprint, write_staged
from syncd.engines.update import Update
from syncd.errors import DeltaError, IntegrityError
from syncd.ops import checksum as _checksum
from syncd.ops import checksum_many
from syncd.ops import delta as _delta

log = logging.getLogger(__name__)

__all__ = ["WeightUpdater", "Written"]

#: The engine's hook for written parameters: ``written(positions, applied)``, called after every write with the
#: staged local flat positions written by local name (None: every parameter, after ``load_full``) and the update just
#: applied (None after a rollback or a full load). Its return value is ignored.
Written = Callable[[Mapping[str, torch.Tensor] | None, StagedUpdate | None], object]


class WeightUpdater:
    """Stage / apply / rollback / load_full / checksum over an engine's live local tensors.

    ``specs`` describe the local parameters (validated: pieces must tile each local shape exactly);
    ``tensors`` maps each spec's name to its live tensor (same dtype and shape; any device; a view that
    flattens without a copy). ``version``: the version those tensors hold now (None: not loaded yet).
    ``ignore_sources``: trainer tensors this engine holds none of (another rank's, or a tied alias of a
    parameter already mapped); updates naming them are accepted and they are skipped. Any other name an
    update carries that no piece uses raises ``DeltaError``. ``written``: the engine's hook for written parameters
    (:data:`Written`), run inside ``apply``/``rollback``/``load_full`` on the caller's thread, so while the engine
    is paused. See the module docstring for what each call does, costs and raises.
    """

    def __init__(self, specs: Sequence[ParamSpec], tensors: Mapping[str, torch.Tensor], *,
                 version: int | None = None, ignore_sources: Iterable[str] = (), written: Written | None = None):
        self._specs = list(specs)
        self._written = written
        self._tensors: dict[str, torch.Tensor] = {}
        self._flat: dict[str, torch.Tensor] = {}
        self._np: dict[str, np.ndarray] = {}  # word views of CPU targets, for the scatter
        self._by_source: dict[str, list[tuple[ParamSpec, ParamPiece]]] = {}
        seen = set()
        for spec in self._specs:
            if spec.name in seen:
                raise ValueError(f"two parameters named {spec.name!r}")
            seen.add(spec.name)
            check_spec(spec)
            if spec.name not in tensors:
                raise ValueError(f"no tensor given for parameter {spec.name!r}")
            t = tensors[spec.name]
            check_like(t, spec.dtype, spec.shape, f"tensor {spec.name!r} is", "its spec says")
            self._tensors[spec.name] = t
            self._flat[spec.name] = flat_view(t, spec.name)
            if t.device.type == "cpu":
                self._np[spec.name] = word_view(self._flat[spec.name]).numpy()
            for p in spec.pieces:
                self._by_source.setdefault(p.source, []).append((spec, p))
        for src, uses in self._by_source.items():
            shapes = {tuple(p.source_shape) for _, p in uses}
            if len(shapes) != 1:
                raise ValueError(f"trainer tensor {src!r} is given different full shapes {sorted(shapes)}")
        self._ignore = frozenset(ignore_sources) - set(self._by_source)
        self._version = version
        self._epoch = 0  # bumped by every write; a staged update is valid only for the epoch it was made in
        self._staged: StagedUpdate | None = None
        self._applied: StagedUpdate | None = None

    # ------------------------------------------------------------------------------------------ facts

    @property
    def version(self) -> int | None:
        return self._version

    @property
    def staged(self) -> StagedUpdate | None:
        """The staged, not yet applied update (None if there is none)."""
        return self._staged

    @property
    def last_applied(self) -> StagedUpdate | None:
        """The update ``rollback`` would undo (None if there is none)."""
        return self._applied

    def parameters(self) -> list[ParamSpec]:
        return list(self._specs)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The live local tensors by local name (not copies)."""
        return dict(self._tensors)

    def sources(self) -> list[str]:
        """Trainer tensor names some local parameter is made from."""
        return list(self._by_source)

    # ------------------------------------------------------------------------------------------ stage

    def stage(self, update: Update) -> StagedUpdate:
        """Stage ``update`` (see the module docstring); replaces any staged, unapplied update. Reads the live
        weights but never writes them. Returns what was staged."""
        if update.kind == "delta":
            if update.base_version != self._version:
                raise ValueError(f"update to version {update.version} applies to base version "
                                 f"{update.base_version}, but the engine holds version {self._version}")
            staged = self._stage_delta(update)
        elif update.kind == "full":
            staged = self._stage_full(update)
        else:
            raise ValueError(f"unknown update kind {update.kind!r} (expected 'delta' or 'full')")
        self._staged = staged
        log.debug("staged version %d (%s): %d words in %d parameters, %d bytes", staged.version, staged.kind,
                  staged.changed, len(staged.params), staged.nbytes)
        return staged

    def _unknown(self, names: Iterable[str]) -> None:
        bad = [n for n in names if n not in self._by_source and n not in self._ignore]
        if bad:
            raise DeltaError(f"update names {len(bad)} tensor(s) this engine does not hold: "
                             f"{', '.join(map(repr, bad[:5]))}{' ...' if len(bad) > 5 else ''}")

    def _stage_delta(self, update: Update) -> StagedUpdate:
        self._unknown(update.tensors)
        parts: dict[str, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        expected: dict[str, int] = {}
        for src, blob in update.tensors.items():
            if src in self._ignore:
                continue
            base = self._whole_base(src)
            try:
                ch = _delta.changes(blob, base=base)
            except DeltaError as exc:
                if base is None and _delta.needs_base(blob):
                    raise DeltaError(f"tensor {src!r}: {self._sliced_message(src)}") from None
                raise DeltaError(f"tensor {src!r}: {exc}") from None
            uses = self._by_source[src]
            spec0, piece0 = uses[0]
            check_like(ch, spec0.dtype, piece0.source_shape, f"tensor {src!r}: blob is for", "the engine holds",
                       DeltaError)
            want = update.checksums.get(src)
            if want is not None and int(want) != ch.new_checksum:
                raise DeltaError(f"tensor {src!r}: blob's result checksum {ch.new_checksum:016x} is not the "
                                 f"update's {int(want):016x}")
            for spec, piece in uses:
                flat = self._flat[spec.name]
                if piece.dim is None:
                    idx, old, new = self._stage_whole(spec, ch, src)
                    expected[spec.name] = ch.new_checksum
                else:
                    idx, old, new = self._stage_piece(spec, flat, piece, ch)
                parts.setdefault(spec.name, []).append((idx, old, new))
        return StagedUpdate(update.version, self._version, "delta", self._merge(parts), self._epoch, expected)

    def _whole_base(self, src: str) -> torch.Tensor | None:
        """The old trainer tensor ``src`` as this engine holds it whole (a view of a local tensor: the parameter
        itself, or its slab of a fused parameter; read, never written), which decoding a format-2 blob with
        context blocks needs; None when this engine holds only slices of it (tensor parallelism)."""
        for spec, piece in self._by_source[src]:
            if piece.dim is None or (piece.start == 0 and piece.stop == piece.source_shape[piece.dim]):
                return local_slab(self._tensors[spec.name], piece)
        return None

    def _sliced_message(self, src: str) -> str:
        pieces = [p for _, p in self._by_source[src]]
        held = ", ".join(f"[{p.start}:{p.stop}) of dim {p.dim}" for p in pieces)
        return (f"its delta has context blocks (format 2), which only an engine holding the whole tensor can "
                f"decode, and this engine holds only {held} of {list(pieces[0].source_shape)}; publish the tensors "
                "that engines hold in slices in format 1 (WeightPublisher's sliced_tensors, the trainer's "
                "--sliced-tensors)")

    def _stage_whole(self, spec, ch, src):
        """1:1 parameter: the old and new words at the changes, with the base and result checksums checked."""
        try:
            old, new = _delta.changed_words(self._tensors[spec.name], ch)
        except DeltaError as exc:
            raise DeltaError(f"tensor {src!r} -> {spec.name!r}: {exc}") from None
        return ch.positions, old, new

    def _stage_piece(self, spec, flat, piece, ch):
        """Sliced or fused piece: keep the positions this piece owns, compute their new words from the old."""
        keep, local = map_positions(ch.positions, piece, spec.shape)
        values = ch.values[keep]
        gathered = flat[local.to(flat.device)].cpu()  # 1-D contiguous, the local dtype
        old = word_view(gathered).clone()
        if local.numel():
            _delta.apply_changes_(gathered, torch.arange(local.numel()), values)
        return local, old, word_view(gathered)

    def _stage_full(self, update: Update) -> StagedUpdate:
        full = self._check_full(update)
        parts: dict[str, list] = {}
        expected: dict[str, int] = {}
        for spec in self._specs:
            flat = self._flat[spec.name]
            new_local = build_local(spec, full, device=flat.device)
            expected[spec.name] = _checksum(new_local)
            nb, ob = word_view(new_local.view(-1)), word_view(flat)
            idx = torch.nonzero(nb != ob).view(-1)
            parts[spec.name] = [(idx.cpu(), ob[idx], nb[idx])]
        return StagedUpdate(update.version, self._version, "full", self._merge(parts), self._epoch, expected)

    def _check_full(self, update: Update) -> Mapping[str, torch.Tensor]:
        """Everything a full version must satisfy before any of it is used."""
        if update.kind != "full":
            raise ValueError(f"expected a full version, got kind {update.kind!r}")
        full = update.tensors
        self._unknown(full)
        for src, uses in self._by_source.items():
            t = full.get(src)
            if t is None:
                raise DeltaError(f"full version {update.version} lacks tensor {src!r}")
            if not isinstance(t, torch.Tensor):
                raise DeltaError(f"full version {update.version}: tensor {src!r} is a {type(t).__name__}, "
                                 "not a torch.Tensor")
            spec, piece = uses[0]
            check_like(t, spec.dtype, piece.source_shape, f"full version {update.version}: tensor {src!r} is",
                       "the engine holds", DeltaError)
            want = update.checksums.get(src)
            if want is not None and _checksum(t) != int(want):
                raise IntegrityError(f"full version {update.version}: tensor {src!r} has checksum "
                                     f"{_checksum(t):016x}, the update says {int(want):016x}")
        return full  # type: ignore[return-value]

    def _merge(self, parts: dict[str, list]) -> list[StagedParam]:
        out = []
        for name, pieces in parts.items():
            if len(pieces) == 1:
                idx, old, new = pieces[0]
            else:
                idx = torch.cat([p[0] for p in pieces])
                order = torch.argsort(idx)
                idx = idx[order]
                old = torch.cat([p[1].cpu() for p in pieces])[order]
                new = torch.cat([p[2].cpu() for p in pieces])[order]
            if idx.numel() == 0:
                continue
            pin = self._flat[name].device.type == "cuda"
            narrow = pin and self._flat[name].numel() < 2 ** 31
            idx = idx.to(torch.int32 if narrow else torch.int64)
            p = StagedParam(name, *(_host(t, pin) for t in (idx, old, new)))
            if pin:
                p.old_fingerprint = fingerprint(p.old, p.index)
            out.append(p)
        return out

    # ------------------------------------------------------------------------------------------ apply

    def apply(self, *, verify: bool = True) -> StagedUpdate:
        """Write the staged update in place, all or nothing; keep it for ``rollback``. With ``verify`` (the
        default) every staged position must still hold its staged old word, compared just before it is
        written; on a mismatch (or any other failure) every word written is put back and ``DeltaError`` is
        raised with the weights exactly as before. If the ``written`` hook raises, the apply is undone (the old
        words, then the hook again for them) and its error raised. Returns what was applied."""
        s = self._staged
        if s is None:
            raise RuntimeError("apply: nothing is staged")
        if s.epoch != self._epoch:
            self._staged = None
            raise DeltaError(f"apply: version {s.version} was staged against version {s.prev_version}, but the "
                             f"weights changed since (now version {self._version}); stage it again")
        write_staged(self._flat, self._np, s.params, new=True, verify=verify, version=s.version)
        self._staged, self._applied = None, s
        self._version = s.version
        self._epoch += 1
        if self._written is not None:
            try:
                self._written(_positions(s), s)
            except BaseException:  # all or nothing: the weights and what the engine computes from them
                self._undo()
                self._written(_positions(s), None)
                raise
        return s

    def rollback(self) -> int | None:
        """Undo the last ``apply`` bit for bit, then run the ``written`` hook; returns the version restored.
        RuntimeError if there is none."""
        s = self._undo()
        if self._written is not None:
            self._written(_positions(s), None)
        return self._version

    def _undo(self) -> StagedUpdate:
        s = self._applied
        if s is None:
            raise RuntimeError("rollback: no applied update to undo")
        write_staged(self._flat, self._np, s.params, new=False)
        self._applied = None
        self._version = s.prev_version
        self._epoch += 1
        return s

    def discard(self) -> None:
        """Drop the staged update and the rollback state (frees their memory)."""
        self._staged = None
        self._applied = None

    # ------------------------------------------------------------------------------------------ full

    def load_full(self, update: Update) -> None:
        """Replace every local weight with full version ``update`` (validated first: names, dtypes, shapes,
        checksums; nothing is written if any fails), then run the ``written`` hook for every parameter. Drops
        the staged update and the rollback state."""
        full = self._check_full(update)
        with torch.no_grad():
            for spec in self._specs:
                local = self._tensors[spec.name]
                for p in spec.pieces:
                    local_slab(local, p).copy_(slab(full[p.source], p))
        self._staged = None
        self._applied = None
        self._version = update.version
        self._epoch += 1
        if self._written is not None:
            self._written(None, None)

    # ------------------------------------------------------------------------------------------ checksum

    def checksum(self, names: Sequence[str] | None = None) -> dict[str, int]:
        """``syncd.ops.checksum`` of local parameters by local name (all when ``names`` is None). Raises
        KeyError for an unknown name. Read-only; safe while serving."""
        names = list(self._tensors) if names is None else list(names)
        missing = [n for n in names if n not in self._tensors]
        if missing:
            raise KeyError(f"no local parameter named {missing[0]!r}")
        tensors = [self._tensors[n] for n in names]
        return dict(zip(names, checksum_many([t if t.is_contiguous() else t.contiguous() for t in tensors])))

    def expected_checksums(self, full: Mapping[str, object]) -> dict[str, int]:
        """:func:`expected_checksums` for this updater's parameters."""
        return expected_checksums(self._specs, full)


def _positions(s: StagedUpdate) -> dict[str, torch.Tensor]:
    """The staged local flat positions of ``s`` by local name (what a ``written`` hook is told)."""
    return {p.name: p.index for p in s.params}


def _host(t: torch.Tensor, pin: bool) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    if pin and torch.cuda.is_available():
        t = t.pin_memory()
    return t
