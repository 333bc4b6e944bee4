"""The engines a Dynamo worker (:mod:`syncd.engine.dynamo.worker`) serves: :func:`build_engine` (the engine the command
line names, with its replay recording) and :func:`check_replay` (what a request may ask of it about replay records).

Engines: ``reference`` (:class:`syncd.engine.reference.ReferenceEngine`, its recorder a
:class:`syncd.engine.replay.ReplayRecorder` in the worker process), ``vllm`` (:class:`syncd.engine.vllm.VLLMEngine`,
recording inside vLLM's worker: ``syncd.engine.vllm.recording``) or ``MODULE:FACTORY``. With ``--replay-store``
every request is recorded; a client that needs the records can say so with the Dynamo annotation
:data:`REPLAY_ANNOTATION` (``nvext.annotations``), which a worker without a replay store refuses.
"""

from __future__ import annotations

import importlib

__all__ = ["REPLAY_ANNOTATION", "build_engine", "check_replay"]

#: the Dynamo request annotation (``nvext.annotations``) by which a client says it needs replay records
REPLAY_ANNOTATION = "syncd.replay"


def check_replay(engine, request, greq) -> None:
    """Refuse (ValueError naming what) a worker request ``request`` (its ``GenerationRequest`` ``greq``) that asks
    for replay records (:data:`REPLAY_ANNOTATION`) of an engine that records none, or whose sampling settings the
    engine cannot record (the engine's ``check_request``, where it has one: e.g. ``top_k`` beyond the
    vocabulary)."""
    notes = request.get("annotations") if isinstance(request, dict) else None
    if isinstance(notes, list) and REPLAY_ANNOTATION in notes and getattr(engine, "recorder", None) is None:
        raise ValueError(f"{REPLAY_ANNOTATION}: replay asked of a worker started without a replay store "
                         "(--replay-store)")
    check = getattr(engine, "check_request", None)
    if check is not None:
        check(greq)


def _replay_run(args) -> str:
    if not args.run_id:
        raise ValueError("--replay-store needs --run-id")
    return args.run_id


def _reference_engine(args):
    """The reference engine on ``args.model`` (its weights are version ``args.weights_version``)."""
    from syncd.engine.reference import ReferenceEngine

    recorder = None
    if args.replay_store:
        from syncd.engine.replay import ReplayRecorder

        recorder = ReplayRecorder(args.replay_store, _replay_run(args), kept_tolerance=args.replay_kept_tolerance,
                                  spill_dir=args.replay_spill_dir)
    return ReferenceEngine.from_pretrained(args.model, version=args.weights_version, max_batch=args.max_batch,
                                           recorder=recorder)


def _vllm_engine(args):
    """vLLM (:class:`syncd.engine.vllm.VLLMEngine`) on ``args.model``; its weights are version ``args.weights_version``.
    With ``--replay-store`` its worker records every request."""
    from syncd.engine.vllm import ReplayConfig, VLLMEngine

    replay = None
    if args.replay_store:
        replay = ReplayConfig(args.replay_store, _replay_run(args), kept_tolerance=args.replay_kept_tolerance,
                              spill_dir=args.replay_spill_dir)
    tp = args.tensor_parallel_size
    return VLLMEngine(args.model, version=args.weights_version, max_num_seqs=args.max_batch,
                      max_model_len=args.max_model_len, replay=replay,
                      engine_kwargs={"tensor_parallel_size": tp} if tp > 1 else None)


def build_engine(args):
    """The engine ``--engine`` names: ``reference``, ``vllm``, or ``MODULE:FACTORY`` where ``FACTORY(args)``
    returns an object implementing ``syncd.engines.Adapter`` and ``syncd.engines.Generator``. Raises
    ValueError/TypeError."""
    spec = args.engine
    if spec in ("reference", "vllm"):
        factory = _reference_engine if spec == "reference" else _vllm_engine
    else:
        mod, sep, name = spec.partition(":")
        if not sep or not mod or not name:
            raise ValueError(f"--engine must be 'reference', 'vllm' or MODULE:FACTORY, got {spec!r}")
        factory = getattr(importlib.import_module(mod), name)
    engine = factory(args)
    from syncd.engines.protocol import Adapter, Generator

    missing = [p.__name__ for p in (Adapter, Generator) if not isinstance(engine, p)]
    if missing:
        raise TypeError(f"--engine {spec}: {type(engine).__name__} does not implement engine.{', '.join(missing)}")
    return engine
