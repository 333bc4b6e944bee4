"""Old import paths kept after a move (the engine contract into syncd.engines, the applications into syncd.app,
the record readers into syncd.records, ...) keep working until 0.3 and give the very same objects (so isinstance
checks and except clauses written against either agree), and each warns (DeprecationWarning) naming the new path.
Names the ``engine`` package itself re-exports, and those an old module still uses itself, do not warn."""

from __future__ import annotations

import importlib

import pytest

from tests.engines._published import setup  # noqa: F401 (the fixture)

DEPRECATED = [
    ("engine.adapter", "Adapter", "syncd.engines.protocol"),
    ("engine.adapter", "Generator", "syncd.engines.protocol"),
    ("engine.adapter", "SamplingParams", "syncd.engines.protocol"),
    ("engine.adapter", "GenerationRequest", "syncd.engines.protocol"),
    ("engine.adapter", "TokenEvent", "syncd.engines.protocol"),
    ("engine.adapter", "Update", "syncd.engines.update"),
    ("engine.adapter", "ParamSpec", "syncd.engines.params"),
    ("engine.adapter", "ParamPiece", "syncd.engines.params"),
    ("engine.local_params", "check_spec", "syncd.engines.params"),
    ("engine.local_params", "map_positions", "syncd.engines.params"),
    ("engine.local_params", "build_local", "syncd.engines.params"),
    ("engine.local_params", "expected_checksums", "syncd.engines.params"),
    ("engine.local_params", "identity_specs", "syncd.engines.params"),
    ("engine.control", "RemoteAdapter", "syncd.engines.client"),
    ("engine.control", "EngineUnreachable", "syncd.engines.errors"),
    ("engine.control", "RemoteEngineError", "syncd.engines.errors"),
    ("engine.control", "OPS", "syncd.engines.wire"),
    ("engine.control", "WEIGHT_OPS", "syncd.engines.wire"),
    ("engine.control", "spec_from_json", "syncd.engines.wire"),
    ("engine.control", "status_of", "syncd.engines.wire"),
    ("engine.proxy.record", "parse", "syncd.records.trajectory"),
    ("engine.proxy.record", "read_record", "syncd.records.trajectory"),
    ("engine.proxy.record", "list_records", "syncd.records.trajectory"),
    ("engine.proxy.record", "replay_tokens", "syncd.records.trajectory"),
    ("engine.replay.format", "decode_chunk", "syncd.records.replay"),
    ("engine.replay.format", "ReplayFormatError", "syncd.records.replay"),
    ("engine.replay.recorder", "read_request", "syncd.records.replay_store"),
    ("engine.replay.recorder", "replay_prefix", "syncd.records.replay_store"),
    ("syncd.cli", "main", "syncd.app.cli"),
    ("syncd.cli", "build_parser", "syncd.app.cli"),
    ("syncd.demo", "run_main", "syncd.app.demo"),
    ("syncd.rl_demo", "run", "syncd.app.rl_demo"),
    ("syncd.rl_stack", "RLStack", "syncd.app.rl_stack"),
    ("syncd.daemon.manifests", "ManifestSource", "syncd.manifest_source"),
    ("syncd.versions", "RetentionPolicy", "syncd.retention"),
    ("syncd.versions", "apply_retention", "syncd.retention"),
    ("syncd.cluster.transfer", "ShardCache", "syncd.cluster.partials.PartialShards"),
]
KEPT = [  # the engine package's own re-exports, and names the old module uses itself
    ("engine", "Update", "syncd.engines.update"),
    ("engine", "Adapter", "syncd.engines.protocol"),
    ("engine.updater", "expected_checksums", "syncd.engines.params"),
    ("engine.control", "BadRequest", "syncd.engines.errors"),
    ("engine.control", "spec_to_json", "syncd.engines.wire"),
    ("engine.proxy.record", "RecordError", "syncd.records.trajectory"),
    ("engine.proxy.record", "check_id", "syncd.records.trajectory"),
]


def _new(new: str, name: str):
    module, _, attr = new.rpartition(".") if new.endswith("PartialShards") else (new, "", name)
    return getattr(importlib.import_module(module), attr)


@pytest.mark.parametrize("old, name, new", DEPRECATED)
def test_an_old_path_gives_the_moved_object_and_warns_with_the_new_one(old, name, new):
    module = importlib.import_module(old)
    target = new if new.endswith("PartialShards") else f"{new}.{name}"
    with pytest.warns(DeprecationWarning, match=rf"{old}\.{name} moved to {target}; the old path goes in 0\.3"):
        value = getattr(module, name)
    assert value is _new(new, name)
    with pytest.warns(DeprecationWarning):  # every importer is told, not only the first
        getattr(module, name)


@pytest.mark.parametrize("old, name, new", KEPT)
def test_a_kept_name_gives_the_same_object_without_a_warning(old, name, new):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        assert getattr(importlib.import_module(old), name) is _new(new, name)


def test_our_own_code_using_an_old_path_is_an_error_under_the_test_configuration():
    import warnings

    with pytest.raises(DeprecationWarning, match="syncd.app.rl_stack.StackConfig"):
        exec("from syncd.rl_stack import StackConfig", {"__name__": "syncd.some_module"})
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("ignore")
        exec("from syncd.rl_stack import StackConfig", {"__name__": "someone_elses"})  # only a warning for them


@pytest.mark.parametrize("module, new", [("syncd.cli", "syncd.app.cli"), ("syncd.demo", "syncd.app.demo"),
                                         ("syncd.rl_demo", "syncd.app.rl_demo")])
def test_running_an_old_module_says_where_it_moved(module, new):
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and f"{module} moved to {new}" in p.stderr, p.stderr[-2000:]


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
    with pytest.warns(DeprecationWarning, match="engine.control.load_full_from_cache moved to"):
        load_full_from_cache(eng, raws[0], cache.root)
    with pytest.warns(DeprecationWarning, match="engine.control.stage_from_cache moved to"):
        stage_from_cache(eng, raws[1], cache.root)
    eng.apply()
    m2 = read_manifest(pub.store, RUN, 2, signing_key=KEY)
    eng.stage(update_from_manifest(m2, fetch_shards(pub.store, RUN, m2)))
    eng.apply()
    assert_same(eng.state_dict(), pub.states[2])
    eng.rollback()
    assert update_from_cache(raws[2], cache.root).tensors.keys() == pub.states[2].keys()
