"""A workaround for vLLM 0.32 on CPU: a seeded request whose prefill is chunked kills the engine.

vLLM samples a token for every row of a step, also for a request whose prefill is not finished (a chunk of a
chunked prefill), and discards that token. To keep a seeded request's draws as if the discarded sample never
happened it rewinds the request's generator (``gen.set_offset(gen.get_offset() - 4)`` in the model runner's
``_bookkeeping_sync``), which a CPU generator cannot do: ``RuntimeError: CPU Generator does not use offset`` ends
the EngineCore. On CPU chunked prefill is on by default (a 2048-token step budget), and the Dynamo worker seeds
every request (``syncd.engine.dynamo.protocol.seed_for``), so any longer prompt hit it.

:func:`install` wraps the model runner's ``sample_tokens`` (an instance attribute): the rows whose token will be
discarded (vLLM's ``discard_request_mask``, set when the step's inputs were prepared) are taken out of the batch's
generator map for the sampling, so their throw-away draw comes from the global generator and the request's own
generator is untouched -- what the rewind was for; the map is restored right after. Threads: vLLM's worker thread.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

__all__ = ["install"]


def install(runner) -> bool:
    """Wrap ``runner.sample_tokens`` (once); returns whether it was installed now."""
    if getattr(runner, "_syncd_seeded_chunks", False):
        return False
    sample = runner.sample_tokens

    def sample_tokens(*args, **kwargs):
        batch = runner.input_batch
        mask = getattr(getattr(runner, "discard_request_mask", None), "np", None)
        held = {}
        if mask is not None and batch.generators:
            for i in [i for i in batch.generators if i < batch.num_reqs and mask[i]]:
                held[i] = batch.generators.pop(i)
        try:
            return sample(*args, **kwargs)
        finally:
            batch.generators.update(held)

    runner.sample_tokens = sample_tokens
    runner._syncd_seeded_chunks = True
    return True
