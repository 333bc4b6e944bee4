"""Replay records: per generated token the weight version, token id, logprob under the sampling distribution,
the top-p kept set and (MoE) the router's top-k experts. The recorder that writes them to the run's store prefix
(``syncd.engine.replay.recorder``); their format and reading them back are in the core (:mod:`syncd.records.replay`,
:mod:`syncd.records.replay_store`; specified in ``docs/replay-format.md``), re-exported here."""

from syncd.engine.replay.recorder import ReplayRecorder, ReplayUploadError
from syncd.records.replay import (ReplayChunk, ReplayFormatError, TokenRecord, decode_chunk, decode_kept, encode_chunk,
                                  encode_kept, pack_routing, unpack_routing)
from syncd.records.replay_store import list_requests, read_request, request_key

__all__ = ["ReplayChunk", "ReplayFormatError", "ReplayRecorder", "ReplayUploadError", "TokenRecord",
           "decode_chunk", "decode_kept", "encode_chunk", "encode_kept", "list_requests", "pack_routing",
           "read_request", "request_key", "unpack_routing"]
