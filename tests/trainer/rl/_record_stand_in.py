"""A stand-in for the serving side of a live run, for ``syncd train`` run as a real process in the trainer's tests:
one HTTP server in place of the sandbox proxy in front of the engines, writing the records in the project's own
formats. The real stack (Dynamo, the proxy, the daemon) is in test_loop_e2e.py; this one starts in a second.

* ``GET /v1/models`` lists the model;
* ``POST /v1/completions`` (``X-Syncd-Trajectory``) tokenizes the prompt with the model folder's tokenizer and
  generates with a :class:`~syncd.engine.reference.ReferenceEngine` in this process on the run's newest version in the
  store (an engine per version, built from the store as a restarted worker would be -- the model folder for
  version 0 --, so the records carry the versions a daemon-driven engine would), whose :class:`~syncd.engine.replay.ReplayRecorder` writes the replay records
  (``kept_tolerance``: sets to rebuild, as ``--replay-kept-tolerance``); the turn is kept for the trajectory;
* ``POST /syncd/trajectories/<id>/finish`` writes the trajectory record (``syncd.engine.proxy.record``) with the
  metadata and answers as the proxy does.

``tamper(trajectory_id) -> dict | None`` makes chosen trajectories lie, in the replay records and the trajectory alike:
``{"logprob_at": i, "logprob": x}`` (the i-th generated token's engine log-prob; a non-finite one is null in the
trajectory, which JSON cannot carry otherwise), ``{"version": v}`` (every token claims version ``v``).

Signing: ``signing_key`` as :func:`syncd.versions.latest_version` takes it (None: ``SYNCD_SIGNING_KEY``, the trainer's).
"""

from __future__ import annotations

import json
import math
import threading

from syncd.engine.proxy.record import Trajectory, Turn, now
from syncd.engine.reference import ReferenceEngine
from syncd.engine.replay import ReplayRecorder
from syncd.engines.protocol import GenerationRequest, SamplingParams
from syncd.store import Store
from syncd.versions import latest_version
from tests.trainer._fake_proxy import ProxyHandler, serve


class _Lying:
    """The recorder the engines write to: ``tamper`` applied to chosen requests' records."""

    def __init__(self, recorder: ReplayRecorder, lies: dict):
        self.recorder, self.lies = recorder, lies

    def add(self, request_id, **kw):
        lie = self.lies.get(request_id) or {}
        if "version" in lie:
            kw["version"] = lie["version"]
        if lie.get("logprob_at") == kw["index"]:
            kw["logprob"] = lie["logprob"]
        return self.recorder.add(request_id, **kw)

    def __getattr__(self, name):
        return getattr(self.recorder, name)


class RecordingStandIn:
    def __init__(self, model_dir, store_url: str, run_id: str, *, signing_key=None, sandbox: str = "sb",
                 kept_tolerance: float | None = None, tamper=None):
        from transformers import AutoTokenizer

        self.model_dir, self.store, self.run_id, self.key = model_dir, Store(store_url), run_id, signing_key
        self.sandbox, self.tamper = sandbox, tamper or (lambda tid: None)
        self.tok = AutoTokenizer.from_pretrained(str(model_dir))
        self.lies: dict = {}
        self.recorder = _Lying(ReplayRecorder(self.store, run_id, chunk_tokens=64, kept_tolerance=kept_tolerance),
                               self.lies)
        self.engines: dict[int, ReferenceEngine] = {}
        self.trajectories: dict[str, Trajectory] = {}
        self.versions_served: list[int] = []
        self._lock = threading.Lock()
        outer = self

        class Handler(ProxyHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                try:
                    if self.path == "/v1/completions":
                        return self._reply(200, outer._complete(self.headers["X-Syncd-Trajectory"], body))
                    return self._reply(200, outer._finish(self.path.split("/")[3], body.get("metadata") or {}))
                except Exception as exc:  # noqa: BLE001 -- the trainer sees an error status, as from a proxy
                    return self._reply(502, {"error": f"{type(exc).__name__}: {exc}"})

        self.server, self.url = serve(Handler)

    def _engine(self) -> tuple[int, ReferenceEngine]:
        with self._lock:
            v = latest_version(self.store, self.run_id, signing_key=self.key)
            if v is None:  # version 0 still uploading: the folder is version 0 (--weights-version 0)
                v = 0
                if v not in self.engines:
                    self.engines[v] = ReferenceEngine.from_pretrained(self.model_dir, version=0,
                                                                      recorder=self.recorder, max_batch=16)
            if v not in self.engines:
                self.engines[v] = ReferenceEngine.from_store(self.store, self.run_id, v, model_dir=self.model_dir,
                                                             signing_key=self.key, recorder=self.recorder,
                                                             max_batch=16)
            self.versions_served.append(v)
            return v, self.engines[v]

    def _complete(self, tid: str, body: dict) -> dict:
        prompt = self.tok.encode(body["prompt"])
        rid = f"{tid}-c"
        lie = self.tamper(tid)
        if lie:
            self.lies[rid] = lie
        _, eng = self._engine()
        sp = SamplingParams(max_tokens=int(body["max_tokens"]), temperature=float(body.get("temperature", 1.0)),
                            top_p=float(body.get("top_p", 1.0)), top_k=int(body.get("top_k", 0)),
                            seed=body.get("seed"))
        evs = eng.generate_sync(GenerationRequest(rid, tuple(prompt), sp), timeout=300)
        out = [e.token_id for e in evs]
        versions = [lie.get("version", e.version) if lie else e.version for e in evs]
        logprobs = [e.logprob for e in evs]
        if lie and "logprob_at" in lie:
            x = lie["logprob"]
            logprobs[lie["logprob_at"]] = x if math.isfinite(x) else None
        turn = Turn(0, "completions", {k: body[k] for k in ("temperature", "top_p", "top_k") if k in body}, False,
                    status="ok", request_id=rid, prompt_token_ids=list(prompt), output_token_ids=out,
                    versions=versions, logprobs=logprobs, finish_reason="length",
                    segments=[{"request_id": rid, "start": 0, "count": len(out)}], finished_at=now())
        tr = Trajectory(self.run_id, self.sandbox, tid)
        tr.turns.append(turn)
        self.trajectories[tid] = tr
        return {"choices": [{"text": self.tok.decode(out), "finish_reason": "length"}],
                "usage": {"completion_tokens": len(out)}}

    def _finish(self, tid: str, metadata: dict) -> dict:
        tr = self.trajectories.pop(tid, None) or Trajectory(self.run_id, self.sandbox, tid)
        tr.metadata, tr.finished_at = dict(metadata), now()
        self.store.put(tr.key, tr.encode(), create=True)
        return {"key": tr.key, "trajectory_id": tid, "status": tr.status, "written": True}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        for eng in self.engines.values():
            eng.close()
        self.recorder.close()
