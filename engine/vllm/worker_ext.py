"""The syncd side inside vLLM's worker process: a backend of vLLM's weight-transfer interface (``"syncd"``) and a
worker extension (``worker_extension_cls="syncd.engine.vllm.worker_ext.SyncdWorkerExtension"``) driven through
``collective_rpc`` by :class:`syncd.engine.vllm.engine.VLLMEngine`.

vLLM imports this module in every worker before it loads the model (it resolves ``worker_extension_cls`` when
it builds the worker), so importing it

* registers the ``syncd`` backend with ``WeightTransferEngineFactory`` (the registry is per process), and
* on CPU keeps the linear layers' weights: vLLM's CPU backend otherwise replaces every linear weight with an
  empty parameter and computes with a private oneDNN-packed copy (``dispatch_cpu_unquantized_gemm(...,
  remove_weight=True)``), so there would be nothing to write in place. ``SYNCD_VLLM_CPU_GEMM=torch`` computes
  with ``F.linear`` over the kept weight instead (no packed copy; slower decode).

The weights syncd writes are vLLM's own parameters in their logical (loader) layout, through one
:class:`syncd.engines.WeightUpdater` per worker over their bf16 words (the fp32 parameters hold bf16-exact
values, as the reference engine's). What vLLM's CPU kernels compute with is derived from them and kept in step
by :mod:`syncd.engine.vllm.cpu_copies` (packed while staging, swapped in by the updater's hook for written
parameters). On a GPU vLLM computes with the parameters themselves and nothing is derived.

Everything here runs on the worker's thread between scheduler steps, except staging, which runs on a thread
of its own while vLLM keeps serving (:meth:`SyncdWorkerExtension.syncd_stage`); results cross the RPC as plain
data (errors as ``{"error": [type name, message]}``, which the front end raises again).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

import torch

from syncd.engine.vllm.cpu_copies import _Derived, _pack_moe_, _unpack_moe, install_cpu_gemm_keep

log = logging.getLogger(__name__)

__all__ = ["SyncdWorkerExtension", "SyncdWeightTransfer", "install_cpu_gemm_keep"]


def _error(exc: BaseException) -> dict:
    return {"error": [type(exc).__name__, str(exc)]}


class _WorkerState:
    """The syncd state of one worker: its updater over the model's parameters and the derived copies."""

    def __init__(self, model, model_config, *, version, rank: int, world_size: int, expert_parallel: bool = False):
        from syncd.engines.params import bf16_view_of_fp32
        from syncd.engines.updater import WeightUpdater
        from syncd.engine.vllm.layout import ModelShape, vllm_specs

        params = dict(model.named_parameters())
        empty = [n for n, p in params.items() if p.numel() == 0]
        if empty:
            raise RuntimeError(f"vLLM replaced {len(empty)} weights with empty parameters (e.g. {empty[0]!r}); "
                               "syncd.engine.vllm.worker_ext was not imported before the model was loaded")
        bad = [n for n, p in params.items() if p.dtype != torch.float32]
        if bad:
            raise ValueError(f"syncd serves vLLM in float32 (bf16-exact values); {bad[0]!r} is "
                             f"{params[bad[0]].dtype}")
        shape = ModelShape.from_config(model_config.hf_text_config)
        self.rank = rank
        self.specs = vllm_specs([(n, p.shape) for n, p in params.items()], shape, rank=rank, world_size=world_size,
                                expert_parallel=expert_parallel)
        self.derived = _Derived(model, params)
        tensors = {s.name: bf16_view_of_fp32(self.derived.tensor(s.name, params[s.name].data)) for s in self.specs}
        self.derive_s = 0.0  # how long the last refresh of the derived copies took
        self.updater = WeightUpdater(self.specs, tensors, version=version, written=self._written)
        self._stage: dict = {"done": True, "result": None}
        self._thread: threading.Thread | None = None
        self.last: dict = {}

    def stage(self, ref: dict) -> None:
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("a stage is already running")
        self._stage = {"done": False, "result": None}
        self.derived.discard()

        def run():
            t = time.perf_counter()
            try:
                s = self.updater.stage(_update_of(ref))
                prepare_s = self.derived.prepare(s)
                res = {"version": s.version, "words": s.changed, "bytes": s.nbytes,
                       "seconds": time.perf_counter() - t, "prepare_s": prepare_s}
            except BaseException as exc:  # handed to the front end, which raises it
                res = _error(exc)
            self._stage = {"done": True, "result": res}

        self._thread = threading.Thread(target=run, name="syncd-stage", daemon=True)
        self._thread.start()

    def _written(self, changed, applied) -> None:
        """The updater's hook for written parameters: bring the derived copies in step (a failure undoes an apply)."""
        self.derive_s = self.derived.refresh(changed, applied)

    def apply(self) -> dict:
        t = time.perf_counter()
        try:
            applied = self.updater.apply(verify=True)
        except BaseException:
            self.derived.discard()
            raise
        t_write = time.perf_counter() - t - self.derive_s
        return {"version": self.updater.version, "words": applied.changed, "write_s": t_write,
                "derive_s": self.derive_s, "swapped": self.derived.swapped, "rebuilt": self.derived.rebuilt}

    def rollback(self) -> dict:
        return {"version": self.updater.rollback()}

    def load_full(self, ref: dict) -> dict:
        t = time.perf_counter()
        self.updater.load_full(_update_of(ref))
        return {"version": self.updater.version, "write_s": time.perf_counter() - t - self.derive_s,
                "derive_s": self.derive_s}


def _update_of(ref: dict):
    """The :class:`~syncd.engines.update.Update` a front end sent (syncd.engine.vllm.engine.update_ref)."""
    from syncd.engine.vllm.transfer import update_from_ref

    return update_from_ref(ref)


# -- the weight-transfer backend ---------------------------------------------------------------------------------

from vllm.distributed.weight_transfer.base import (  # noqa: E402
    WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory  # noqa: E402


@dataclass
class SyncdInitInfo(WeightTransferInitInfo):
    """``version``: the weight version the loaded checkpoint is (None: unknown)."""

    version: int | None = None


@dataclass
class SyncdUpdateInfo(WeightTransferUpdateInfo):
    """``op``: ``"apply"`` (the staged update), ``"rollback"`` or ``"load_full"`` (with ``ref``, a full version
    as :func:`syncd.engine.vllm.transfer.update_ref` describes it)."""

    op: str = "apply"
    ref: dict | None = None


class SyncdWeightTransfer(WeightTransferEngine[SyncdInitInfo, SyncdUpdateInfo]):
    """vLLM's weight-transfer interface over syncd's in-place apply. The bytes are not pushed by a trainer:
    the worker staged them itself from the node cache (``syncd_stage``), so ``receive_weights`` writes the
    staged words in place and rebuilds the derived copies; ``start``/``finish`` have nothing to do (the
    interface's own advice for in-place engines). ``finish_weight_update(weight_version=...)`` on the
    front end labels the following tokens. A failed write raises (vLLM then ends the update session) and
    leaves the weights as they were; its typed error waits in ``state.last``."""

    init_info_cls = SyncdInitInfo
    update_info_cls = SyncdUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model):
        super().__init__(config, vllm_config, device, model)
        self.vllm_config, self.model = vllm_config, model
        self.state: _WorkerState | None = None

    def init_transfer_engine(self, init_info: SyncdInitInfo) -> None:
        pc = self.vllm_config.parallel_config
        from vllm.distributed import get_tensor_model_parallel_rank

        ep = bool(pc.enable_expert_parallel)
        if ep and (pc.data_parallel_size != 1 or pc.expert_placement_strategy != "linear" or pc.enable_eplb):
            raise ValueError("syncd maps expert parallelism with one data-parallel rank, vLLM's linear expert "
                             f"placement and no EPLB (got data_parallel_size={pc.data_parallel_size}, "
                             f"expert_placement_strategy={pc.expert_placement_strategy!r}, "
                             f"enable_eplb={pc.enable_eplb})")
        self.state = _WorkerState(self.model, self.vllm_config.model_config, version=init_info.version,
                                  rank=get_tensor_model_parallel_rank(), world_size=pc.tensor_parallel_size,
                                  expert_parallel=ep)

    def start_weight_update(self) -> None:
        self._need_state()

    def finish_weight_update(self) -> None:
        pass

    def receive_weights(self, update_info: SyncdUpdateInfo) -> None:
        st = self._need_state()
        st.last = {}
        try:
            if update_info.op == "apply":
                st.last = st.apply()
            elif update_info.op == "rollback":
                st.last = st.rollback()
            elif update_info.op == "load_full":
                st.last = st.load_full(update_info.ref or {})
            else:
                raise ValueError(f"unknown syncd weight op {update_info.op!r}")
        except BaseException as exc:
            st.last = _error(exc)
            raise

    def shutdown(self) -> None:
        self.state = None

    def _need_state(self) -> _WorkerState:
        if self.state is None:
            raise RuntimeError("the syncd weight transfer was not initialised (init_weight_transfer_engine)")
        return self.state


if "syncd" not in WeightTransferEngineFactory._registry:
    WeightTransferEngineFactory.register_engine("syncd", SyncdWeightTransfer)
install_cpu_gemm_keep(os.environ.get("SYNCD_VLLM_CPU_GEMM", "onednn"))


class SyncdWorkerExtension:
    """Methods vLLM mixes into its worker class; the front end calls them by name with ``collective_rpc``.
    They return plain data (errors as ``{"error": [type, message]}``)."""

    def _syncd(self) -> _WorkerState:
        wte = getattr(self, "weight_transfer_engine", None)
        if not isinstance(wte, SyncdWeightTransfer) or wte.state is None:
            raise RuntimeError("start vLLM with weight_transfer_config={'backend': 'syncd'} and call "
                               "init_weight_transfer_engine first")
        return wte.state

    def syncd_specs(self) -> list:
        from syncd.engines.wire import spec_to_json

        return [spec_to_json(s) for s in self._syncd().specs]

    def syncd_stage(self, ref: dict) -> dict:
        try:
            self._syncd().stage(ref)
            return {"started": True}
        except BaseException as exc:
            return _error(exc)

    def syncd_stage_poll(self) -> dict:
        return self._syncd()._stage

    def syncd_last(self) -> dict:
        return self._syncd().last

    def syncd_checksum(self, names=None) -> dict:
        """Checksums of this rank's parameters: all, or ``names[rank]`` (one list of local names per rank)."""
        try:
            st = self._syncd()
            mine = None if names is None else names[st.rank]
            return {"checksums": {k: str(v) for k, v in st.updater.checksum(mine).items()}}
        except BaseException as exc:
            return _error(exc)

    def syncd_end_update(self) -> bool:
        """End this rank's weight-update session if it is still open: vLLM ends it only on a rank whose
        ``update_weights`` raised, so after a tensor-parallel write that failed on another rank this one's stays
        open and the next ``start_weight_update`` would be refused. Returns whether one was open."""
        if getattr(self, "_weight_update_active", False):
            self.finish_weight_update()
            return True
        return False

    def syncd_rollback_if(self, version) -> dict:
        """Undo this rank's last apply if it is the one of ``version`` (a tensor-parallel apply another rank
        failed); nothing otherwise. Returns this rank's version after."""
        try:
            st = self._syncd()
            last = st.updater.last_applied
            if st.updater.version == version and last is not None and last.version == version:
                st.rollback()
            return {"version": st.updater.version}
        except BaseException as exc:
            return _error(exc)

    def syncd_version(self):
        return self._syncd().updater.version

    def syncd_seeded_chunks_fix(self) -> bool:
        """Install :mod:`syncd.engine.vllm.cpu_seeded_chunks` (CPU: a seeded request's chunked prefill would kill
        the engine); whether it was installed now."""
        from syncd.engine.vllm.cpu_seeded_chunks import install

        return install(self.model_runner)

    # -- replay records (syncd.engine.vllm.recording) ------------------------------------------------------------

    def syncd_replay_start(self, store: str, run_id: str, kept_tolerance=None, chunk_tokens: int = 1024,
                           spill_dir=None, retry_s: float = 5.0) -> dict:
        """Record the replay requests of this worker into ``store`` (a URL or path) under ``run_id`` with a
        :class:`syncd.engine.replay.ReplayRecorder` of its own. Only the first tensor-parallel rank records (every
        rank samples the same tokens). Returns ``{"recording": bool, "writer": str | None}``."""
        try:
            from vllm.distributed import get_tensor_model_parallel_rank

            if getattr(self, "_syncd_tap", None) is not None:
                raise RuntimeError("replay recording already started")
            if get_tensor_model_parallel_rank() != 0:
                return {"recording": False, "writer": None}
            from syncd.engine.replay import ReplayRecorder
            from syncd.engine.vllm.recording import ReplayTap

            state = self._syncd()
            recorder = ReplayRecorder(store, run_id, kept_tolerance=kept_tolerance, chunk_tokens=chunk_tokens,
                                      spill_dir=spill_dir, retry_s=retry_s)
            try:
                self._syncd_tap = ReplayTap(self.model_runner, recorder, lambda: state.updater.version)
            except BaseException:
                recorder.close(timeout=5)
                raise
            return {"recording": True, "writer": recorder.writer}
        except BaseException as exc:
            return _error(exc)

    def syncd_replay_flush(self, timeout: float = 60.0) -> dict:
        """Write every buffered record (running requests' too) and wait for the store; this rank's tap counters
        (``{}`` where it does not record). A store that still refuses raises ``ReplayUploadError`` at the front end
        (the chunks stay queued, spilled where a spill directory was given)."""
        tap = getattr(self, "_syncd_tap", None)
        if tap is None:
            return {}
        try:
            tap.recorder.flush(timeout)
            return tap.stats() | {"written": len(tap.recorder.written)}
        except BaseException as exc:
            return _error(exc)

    def syncd_replay_stop(self, timeout: float = 60.0) -> dict:
        """Stop recording: unwrap vLLM's runner and close the recorder (flushing it)."""
        tap, self._syncd_tap = getattr(self, "_syncd_tap", None), None
        if tap is None:
            return {}
        try:
            tap.close()
            tap.recorder.close(timeout)
            return tap.stats()
        except BaseException as exc:
            return _error(exc)

    def syncd_moe_consistent(self) -> bool:
        """Whether every packed expert copy equals vLLM's own packing of its logical tensor (diagnostics)."""
        for m in self._syncd().derived.moe.values():
            check = torch.empty_like(m.logical)
            _pack_moe_(m.logical, check, m.isa)
            if not torch.equal(check.view(torch.int32), getattr(m.module, m.attr).data.view(torch.int32)):
                return False
        return True

    def syncd_full_reload(self, path: str, repeat: int = 3) -> dict:
        """vLLM's own full reload of the weights in safetensors file ``path`` (``reload_weights``), timed
        ``repeat`` times: the baseline ``bench.engine_update --engine vllm`` compares the in-place apply with.
        The kept weights and derived copies are rebuilt by vLLM's reload itself."""
        from safetensors.torch import load_file

        sd = load_file(path)
        times = []
        for _ in range(repeat):
            t = time.perf_counter()
            self.model_runner.reload_weights(weights_iterator=iter(list(sd.items())), is_checkpoint_format=True)
            times.append(time.perf_counter() - t)
        for m in self._syncd().derived.moe.values():  # vLLM reloaded the packed copies: follow them
            m.logical.copy_(_unpack_moe(getattr(m.module, m.attr).data))
        return {"reload_s": times, "bytes": sum(v.numel() * v.element_size() for v in sd.values())}
