"""A reference engine whose process dies (SIGKILL) half a second after it made the last token of a request with
seed ``DIE_SEED``: the frontend then has every token but not the end of the stream, the case where its
migration asks another worker for 0 more tokens. Used by ``--engine tests.dynamo._dying_engine:make``."""

from __future__ import annotations

import asyncio
import os
import signal

from syncd.engine.reference import ReferenceEngine

DIE_SEED = 4242


class DyingAfterLastToken(ReferenceEngine):
    async def generate(self, request):
        async for ev in super().generate(request):
            yield ev
            if ev.finish_reason is not None and request.sampling.seed == DIE_SEED:
                await asyncio.sleep(0.5)  # the last chunk leaves the worker; its stream's end does not
                os.kill(os.getpid(), signal.SIGKILL)


def make(args):
    return DyingAfterLastToken.from_pretrained(args.model, version=args.weights_version)
