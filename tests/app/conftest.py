"""The applications (syncd.app) are tested with the daemon's fixtures: a published store of a tiny model."""

from tests.daemon.conftest import published  # noqa: F401 (the fixture)


def delta_formats_in(store_dir) -> dict[int, int]:
    """How many published delta tensors of every run in the file store at ``store_dir`` are in each codec format,
    counting format-2 tensors with context blocks (which engines decode against their own weights) as ``-2``."""
    from pathlib import Path

    from syncd.engines.update import tensors_of
    from syncd.ops import delta
    from syncd.signing import UNCHECKED
    from syncd.store import Store
    from syncd.versions import fetch_shards, list_versions

    store, counts = Store(store_dir), {}
    for run in sorted(p.name for p in (Path(store_dir) / "runs").iterdir()):
        for info in list_versions(store, run, signing_key=UNCHECKED):
            m = info.manifest
            if m is None or m.kind != "delta":
                continue
            for blob in tensors_of(m, fetch_shards(store, run, m)).values():
                k = -2 if delta.needs_base(blob) else delta.inspect(blob)["format_version"]
                counts[k] = counts.get(k, 0) + 1
    return counts
