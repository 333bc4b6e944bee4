"""Replay records: per generated token the weight version, token id, logprob under the sampling distribution,
the top-p kept set and (MoE) the router's top-k experts; compact binary encodings (``engine.replay.format``,
specified in ``docs/replay-format.md``) and the recorder that writes them to the run's store prefix
(``engine.replay.recorder``)."""

from engine.replay.format import (ReplayChunk, ReplayFormatError, TokenRecord, decode_chunk, decode_kept,
                                  encode_chunk, encode_kept, pack_routing, unpack_routing)
from engine.replay.recorder import ReplayRecorder, ReplayUploadError, list_requests, read_request, request_key

__all__ = ["ReplayChunk", "ReplayFormatError", "ReplayRecorder", "ReplayUploadError", "TokenRecord",
           "decode_chunk", "decode_kept", "encode_chunk", "encode_kept", "list_requests", "pack_routing",
           "read_request", "request_key", "unpack_routing"]
