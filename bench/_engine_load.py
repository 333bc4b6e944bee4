"""The serving side shared by the engine update benchmarks (``bench.engine_update`` and its vLLM run): the model
config they build, the client load an engine serves while it is updated, and the cache-line accounting of the
physical limit.

Thread-safety: :class:`Load`'s counters are updated under its lock by its client threads; read them after
:meth:`Load.finish`.
"""

from __future__ import annotations

import threading

import numpy as np

from bench._timing import Stopwatch

__all__ = ["LINE", "qwen2_config", "client_request", "Load", "tokens_during", "touched_lines"]

LINE = 64  # bytes per cache line


def qwen2_config(cfg: dict):
    """A Qwen2 config of the preset ``cfg`` (untied embeddings, positions for the longest request)."""
    from transformers import Qwen2Config

    return Qwen2Config(hidden_size=cfg["hidden"], num_hidden_layers=cfg["layers"],
                       num_attention_heads=cfg["heads"], num_key_value_heads=cfg["kv_heads"],
                       intermediate_size=cfg["intermediate"], vocab_size=cfg["vocab"],
                       max_position_embeddings=max(128, cfg["seq"], cfg["prompt"] + cfg["max_tokens"] + 8),
                       tie_word_embeddings=False)


def client_request(cfg: dict, g: np.random.Generator, client: int, n: int):
    """Client ``client``'s ``n``-th request of the load: a random prompt of ``cfg["prompt"]`` tokens below
    ``cfg["vocab"]``, ``cfg["max_tokens"]`` sampled at temperature 1, top-p 0.95, seeded by ``n``."""
    from syncd.engines.protocol import GenerationRequest, SamplingParams

    prompt = tuple(int(x) for x in g.integers(0, cfg["vocab"], cfg["prompt"]))
    return GenerationRequest(f"c{client}-{n}", prompt, SamplingParams(max_tokens=cfg["max_tokens"], temperature=1.0,
                                                                      top_p=0.95, seed=n))


class Load:
    """``clients`` threads, each keeping one request running on the engine until stopped."""

    def __init__(self, engine, cfg: dict, seed: int):
        self.engine, self.cfg = engine, cfg
        self.stop = threading.Event()
        self.submitted = self.completed = 0
        self.failures: list[str] = []
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._client, args=(i, seed), daemon=True)
                        for i in range(cfg["clients"])]

    def start(self):
        for t in self.threads:
            t.start()

    def _client(self, i: int, seed: int):
        g = np.random.default_rng(seed + i)
        n = 0
        while not self.stop.is_set():
            req = client_request(self.cfg, g, i, n)
            n += 1
            with self._lock:
                self.submitted += 1
            try:
                events = self.engine.generate_sync(req, timeout=600)
            except Exception as exc:  # noqa: BLE001 - counted as a lost request
                with self._lock:
                    self.failures.append(f"{req.request_id}: {exc}")
                continue
            ok = (events and events[-1].finish_reason in ("length", "stop")
                  and [e.index for e in events] == list(range(len(events))))
            with self._lock:
                if ok:
                    self.completed += 1
                else:
                    self.failures.append(f"{req.request_id}: ended {events[-1].finish_reason if events else None}")

    def finish(self, timeout: float = 600):
        self.stop.set()
        for t in self.threads:
            t.join(timeout)


def tokens_during(engine, seconds: float, stop: threading.Event | None = None) -> tuple[int, float]:
    sw, n0 = Stopwatch(), engine.stats.tokens
    (stop or threading.Event()).wait(seconds)
    return engine.stats.tokens - n0, sw.elapsed


def touched_lines(updater, staged) -> int:
    """Cache lines (of the engine's storage) holding at least one changed word of ``staged``."""
    lines = 0
    for p in staged.params:
        t = updater.tensors()[p.name]
        base = t.data_ptr()
        stride = t.view(-1).stride(0) * t.element_size()
        addr = base + p.index.numpy().astype(np.int64) * stride  # int32 positions on GPUs
        lines += int(np.unique(addr // LINE).size)
    return lines
