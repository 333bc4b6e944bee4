"""A file store that refuses every replay chunk while ``refuse`` is set (the recorder's retry and spill tests)."""

from __future__ import annotations

from syncd.errors import StoreError
from syncd.store import Store


class RefusingStore(Store):
    def __init__(self, root):
        super().__init__(root)
        self.refuse = True

    def put(self, key, data, *, create=False):
        if self.refuse and "/replay/" in key:
            raise StoreError(f"injected refusal writing {key}")
        return super().put(key, data, create=create)
