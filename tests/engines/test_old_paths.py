"""The engine contract moved into syncd.engines; its old import paths keep working for one release and give the
very same objects (so isinstance checks and except clauses written against either agree)."""

from __future__ import annotations

import importlib

import pytest

from tests.engines._published import setup  # noqa: F401 (the fixture)

MOVED = [
    ("engine.adapter", "Adapter", "syncd.engines.protocol"),
    ("engine.adapter", "Generator", "syncd.engines.protocol"),
    ("engine.adapter", "SamplingParams", "syncd.engines.protocol"),
    ("engine.adapter", "GenerationRequest", "syncd.engines.protocol"),
    ("engine.adapter", "TokenEvent", "syncd.engines.protocol"),
    ("engine.adapter", "Update", "syncd.engines.update"),
    ("engine.adapter", "ParamSpec", "syncd.engines.params"),
    ("engine.adapter", "ParamPiece", "syncd.engines.params"),
    ("engine", "Update", "syncd.engines.update"),
    ("engine", "Adapter", "syncd.engines.protocol"),
    ("engine.local_params", "check_spec", "syncd.engines.params"),
    ("engine.local_params", "map_positions", "syncd.engines.params"),
    ("engine.local_params", "build_local", "syncd.engines.params"),
    ("engine.local_params", "expected_checksums", "syncd.engines.params"),
    ("engine.local_params", "identity_specs", "syncd.engines.params"),
    ("engine.updater", "expected_checksums", "syncd.engines.params"),
    ("engine.control", "RemoteAdapter", "syncd.engines.client"),
    ("engine.control", "EngineUnreachable", "syncd.engines.errors"),
    ("engine.control", "RemoteEngineError", "syncd.engines.errors"),
    ("engine.control", "BadRequest", "syncd.engines.errors"),
    ("engine.control", "OPS", "syncd.engines.wire"),
    ("engine.control", "WEIGHT_OPS", "syncd.engines.wire"),
    ("engine.control", "spec_to_json", "syncd.engines.wire"),
    ("engine.control", "spec_from_json", "syncd.engines.wire"),
    ("engine.control", "status_of", "syncd.engines.wire"),
    ("engine.control", "stage_from_cache", "syncd.engines.client"),
    ("engine.control", "load_full_from_cache", "syncd.engines.client"),
]


@pytest.mark.parametrize("old, name, new", MOVED)
def test_an_old_path_gives_the_moved_object(old, name, new):
    assert getattr(importlib.import_module(old), name) is getattr(importlib.import_module(new), name)


def test_the_kept_helpers_still_drive_an_engine(setup):
    import engine
    from engine.control import load_full_from_cache, stage_from_cache
    from engine.updater import update_from_manifest
    from syncd.cache import update_from_cache
    from syncd.versions import fetch_shards, read_manifest
    from tests.daemon.conftest import KEY, RUN
    from tests.store._models import assert_same

    pub, cache, raws = setup
    eng = engine.StateDictEngine(pub.zeros(), None)
    eng.pause()
    load_full_from_cache(eng, raws[0], cache.root)
    stage_from_cache(eng, raws[1], cache.root)
    eng.apply()
    m2 = read_manifest(pub.store, RUN, 2, signing_key=KEY)
    eng.stage(update_from_manifest(m2, fetch_shards(pub.store, RUN, m2)))
    eng.apply()
    assert_same(eng.state_dict(), pub.states[2])
    eng.rollback()
    assert update_from_cache(raws[2], cache.root).tensors.keys() == pub.states[2].keys()
