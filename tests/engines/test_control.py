"""syncd.engines.control.EngineControl: the weight routes as pure handlers driving a real engine
(engine.StateDictEngine): lease, run checks, signature checks. (The client over a real server:
``tests/engines/test_client.py``.)"""

from __future__ import annotations

import pytest

from syncd import engine
from syncd.engines.control import EngineControl
from syncd.engines.errors import BadRequest
from syncd.engines.wire import spec_from_json, spec_to_json
from syncd.errors import LeaseHeld, NotAuthorized
from syncd.signing import parse_key
from syncd.versions import read_manifest
from tests.daemon.conftest import KEY, RUN
from tests.engines._published import setup  # noqa: F401 (the fixture)
from tests.store._models import assert_same


TOKEN = "t" * 64
LEASE = {"lease": {"holder": "holder-a", "run_id": RUN, "pid": 1, "ttl_s": 30}}


def handlers(eng, **kw):
    """``handle(eng, op, body)``: the routes of a real EngineControl, called as the daemon would."""
    control = EngineControl(eng, token=TOKEN, signing_key=KEY, **kw)
    return lambda _eng, op, body: control.call(op, {**LEASE, **body}, TOKEN)


def test_handlers_drive_an_engine_through_an_update(setup):
    pub, cache, raws = setup
    eng = engine.StateDictEngine(pub.zeros(), None)
    handle = handlers(eng)
    body = lambda v: {"manifest": raws[v].decode(), "cache_root": str(cache.root)}  # noqa: E731
    state = handle(eng, "version", {})
    assert (state["run_id"], state["version"], state["writes"], state["lease"]) == (None, None, 0, None)
    handle(eng, "pause", {})
    assert handle(eng, "load_full", body(0)) == {"version": 0, "writes": 1}
    assert handle(eng, "stage", body(1)) == {"version": 1}
    assert handle(eng, "apply", {}) == {"version": 1, "writes": 2}
    state = handle(eng, "version", {})
    assert (state["run_id"], state["version"], state["lease"]["run_id"], state["lease"]["pid"]) == (RUN, 1, RUN, 1)
    handle(eng, "resume", {})
    assert_same(eng.state_dict(), pub.states[1])
    sums = handle(eng, "checksum", {"names": None})["checksums"]
    m1 = read_manifest(pub.store, RUN, 1, signing_key=KEY)
    assert sums == {t.name: f"{t.checksum:016x}" for t in m1.tensors}
    handle(eng, "pause", {})
    assert handle(eng, "rollback", {}) == {"version": 0, "writes": 3}
    assert_same(eng.state_dict(), pub.states[0])
    specs = handle(eng, "parameters", {})["parameters"]
    assert [spec_from_json(s) for s in specs] == list(eng.parameters())
    assert spec_to_json(spec_from_json(specs[0])) == specs[0]


def test_handlers_refuse_bad_requests(setup):
    pub, cache, raws = setup
    eng = engine.StateDictEngine(pub.zeros(), None)
    handle = handlers(eng)
    with pytest.raises(KeyError, match="unknown engine op"):
        handle(eng, "explode", {})
    with pytest.raises(BadRequest, match="manifest"):
        handle(eng, "stage", {"cache_root": str(cache.root)})
    with pytest.raises(BadRequest, match="names"):
        handle(eng, "checksum", {"names": "all"})
    handle(eng, "pause", {})
    with pytest.raises(ValueError, match="full version"):  # a delta is not a full version
        handle(eng, "load_full", {"manifest": raws[1].decode(), "cache_root": str(cache.root)})
    with pytest.raises(FileNotFoundError, match="not in the cache"):
        handle(eng, "load_full", {"manifest": raws[0].decode(), "cache_root": str(cache.root / "elsewhere")})
    assert eng.version is None  # nothing was loaded by the refused requests


def test_engine_control_owns_the_engine_one_lease_at_a_time(setup):
    pub, cache, raws = setup
    now = [100.0]
    control = EngineControl(engine.StateDictEngine(pub.zeros(), None), token=TOKEN, signing_key=KEY,
                            clock=lambda: now[0])
    a = {"lease": {"holder": "daemon-a", "run_id": RUN, "pid": 11, "ttl_s": 5}}
    b = {"lease": {"holder": "daemon-b", "run_id": "run-b", "pid": 22, "ttl_s": 5}}
    with pytest.raises(NotAuthorized):
        control.call("version", {}, None)
    with pytest.raises(NotAuthorized):
        control.call("version", {}, "x" * 64)
    with pytest.raises(BadRequest, match="lease"):
        control.call("pause", {}, TOKEN)  # a weight op without a lease
    control.call("pause", a, TOKEN)
    control.call("load_full", {**a, "manifest": raws[0].decode(), "cache_root": str(cache.root)}, TOKEN)
    state = control.call("version", {}, TOKEN)
    assert (state["run_id"], state["version"], state["writes"], state["lease"]["pid"]) == (RUN, 0, 1, 11)
    for op in ("lease", "resume", "apply"):  # a second controller is refused, naming the holder
        with pytest.raises(LeaseHeld, match=rf"run '{RUN}' \(pid 11\)"):
            control.call(op, b, TOKEN)
    now[0] += 4
    control.call("lease", a, TOKEN)  # renewed ...
    now[0] += 4
    with pytest.raises(LeaseHeld):
        control.call("lease", b, TOKEN)  # ... so still held 8 s after it was taken
    now[0] += 6
    control.call("lease", b, TOKEN)  # expired: b takes it
    with pytest.raises(ValueError, match="run 'r' sent by the controller of run 'run-b'"):
        control.call("stage", {**b, "manifest": raws[1].decode(), "cache_root": str(cache.root)}, TOKEN)
    control.call("release", b, TOKEN)
    assert control.call("version", {}, TOKEN)["lease"] is None
    control.call("stage", {**a, "manifest": raws[1].decode(), "cache_root": str(cache.root)}, TOKEN)
    assert control.call("apply", a, TOKEN) == {"version": 1, "writes": 2}


def test_engine_control_verifies_signatures_itself(setup):
    from dataclasses import replace

    from syncd import manifest as mf
    from syncd.errors import SignatureError

    pub, cache, raws = setup
    eng = engine.StateDictEngine(pub.zeros(), None)
    handle = handlers(eng)
    handle(eng, "pause", {})
    m0 = mf.parse(raws[0], key=parse_key(KEY))
    for forged in (replace(m0, step=99).encode(None), replace(m0, step=99).encode(parse_key("k" * 32))):
        with pytest.raises(SignatureError):
            handle(eng, "load_full", {"manifest": forged.decode(), "cache_root": str(cache.root)})
    assert eng.version is None
    # without a key the engine trusts its authenticated controller (which verified the manifest)
    unchecked = EngineControl(eng, token=TOKEN, signing_key=False)
    assert unchecked.call("load_full", {**LEASE, "manifest": replace(m0, step=99).encode(None).decode(),
                                        "cache_root": str(cache.root)}, TOKEN)["version"] == 0
