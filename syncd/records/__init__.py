"""Records that engines and the sandbox proxy write to a run's store and trainers read back: the formats live in
the core so that neither side imports the other.

- :mod:`syncd.records.replay`: per-token replay records (version, token, log-prob, kept set, MoE routes)
  (``docs/replay-format.md``); :mod:`syncd.records.replay_store`: their store keys and ``read_request``;
  ``syncd.engine.replay.ReplayRecorder`` writes them
- :mod:`syncd.records.trajectory`: the proxy's trajectory records, read and checked (``syncd.engine.proxy`` writes them)
"""

from syncd.records.replay import (ReplayChunk, ReplayFormatError, TokenRecord, decode_chunk, decode_kept,
                                  encode_chunk, encode_kept, pack_routing, unpack_routing)
from syncd.records.replay_store import list_requests, read_request, request_key
from syncd.records.trajectory import RecordError, list_records, parse, read_record, record_key, replay_tokens

__all__ = ["RecordError", "ReplayChunk", "ReplayFormatError", "TokenRecord", "decode_chunk", "decode_kept",
           "encode_chunk", "encode_kept", "list_records", "list_requests", "pack_routing", "parse", "read_record",
           "read_request", "record_key", "replay_tokens", "request_key", "unpack_routing"]
