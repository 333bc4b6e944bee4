"""Moved to :mod:`syncd.records.replay` (the record format is shared by engines and trainers); kept until 0.3: each
name imported from here warns (DeprecationWarning) with its new path."""

from syncd.lazy import lazy_names

__all__ = ["ReplayFormatError", "encode_kept", "decode_kept", "pack_routing", "unpack_routing", "TokenRecord",
           "ReplayChunk", "encode_chunk", "decode_chunk", "FORMAT_VERSION", "MAGIC"]

__getattr__ = lazy_names(__name__, {n: "syncd.records.replay" for n in __all__}, deprecated=True)
