"""Moved to :mod:`syncd.records.replay` (the record format is shared by engines and trainers); these names are
re-exported here, kept for one release."""

from syncd.records.replay import (FORMAT_VERSION, MAGIC, ReplayChunk, ReplayFormatError, TokenRecord,  # noqa: F401
                                  decode_chunk, decode_kept, encode_chunk, encode_kept, pack_routing, unpack_routing)

__all__ = ["ReplayFormatError", "encode_kept", "decode_kept", "pack_routing", "unpack_routing", "TokenRecord",
           "ReplayChunk", "encode_chunk", "decode_chunk", "FORMAT_VERSION", "MAGIC"]
