"""engine.control: the weight routes as pure handlers, over a real loopback HTTP server, and
RemoteAdapter driving a real engine (engine.StateDictEngine) through them."""

from __future__ import annotations

import http.client
import json

import pytest

import engine
from engine.control import (BadRequest, EngineControl, EngineUnreachable, RemoteAdapter, load_full_from_cache,
                            spec_from_json, spec_to_json, stage_from_cache)
from engine.control_server import ControlServer
from syncd.cache import ShardCache
from syncd.errors import DeltaError, LeaseHeld, NotAuthorized
from syncd.signing import parse_key
from syncd.versions import fetch_shards, read_manifest
from tests.daemon.conftest import KEY, RUN, Published, free_port
from tests.store._models import assert_same


@pytest.fixture
def setup(tmp_path):
    """Versions 0 (full), 1, 2 (deltas) in a store; their shards and manifests in a node cache."""
    pub = Published(tmp_path / "store")
    pub.publish(3)
    cache = ShardCache(tmp_path / "cache")
    raws = {}
    for v in range(3):
        m = read_manifest(pub.store, RUN, v, signing_key=KEY)
        for s, data in zip(m.shards, fetch_shards(pub.store, RUN, m)):
            cache.put(s.sha256, data)
        raws[v] = pub.store.get(f"runs/{RUN}/versions/{v:012d}/manifest.json")
    yield pub, cache, raws
    pub.close()


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


def test_remote_adapter_over_a_real_server(setup):
    pub, cache, raws = setup
    eng = engine.StateDictEngine(pub.zeros(), None)
    server = ControlServer(eng, port=free_port()).start()
    try:
        remote = RemoteAdapter(server.url)
        assert isinstance(remote, engine.Adapter)
        assert remote.version is None
        assert list(remote.parameters()) == list(eng.parameters())
        remote.pause()
        load_full_from_cache(remote, raws[0], cache.root)
        stage_from_cache(remote, raws[1], cache.root)
        remote.apply()
        remote.resume()
        assert remote.version == 1
        assert remote.checksum() == eng.checksum()
        assert_same(eng.state_dict(), pub.states[1])
        # errors come back with their type: applying nothing staged is a state error (409) ...
        remote.pause()
        with pytest.raises(RuntimeError):
            remote.apply()
        # ... a delta for another base is a ValueError (422), and the weights are untouched
        with pytest.raises(ValueError, match="base version"):
            stage_from_cache(remote, raws[1], cache.root)
        with pytest.raises(TypeError, match="stage_from_cache"):
            remote.stage(engine.Update(version=2, kind="delta", tensors={}))
        assert remote.version == 1
        # unknown routes and malformed bodies
        auth = {"Authorization": f"Bearer {remote.credentials()['auth']}"}
        conn = http.client.HTTPConnection(server.host, server.port, timeout=10)
        conn.request("POST", "/engine/weights/explode", body=b"{}", headers=auth)
        resp = conn.getresponse()
        assert resp.status == 404 and json.loads(resp.read())["type"] == "KeyError"
        conn = http.client.HTTPConnection(server.host, server.port, timeout=10)
        conn.request("POST", "/engine/weights/checksum", body=b"not json", headers=auth)
        resp = conn.getresponse()
        assert resp.status == 400 and "not valid JSON" in json.loads(resp.read())["error"]
    finally:
        server.close()
    with pytest.raises(EngineUnreachable):
        RemoteAdapter(server.url, connect_timeout_s=2).version


def test_a_corrupt_blob_is_a_delta_error_across_the_wire(setup, tmp_path):
    pub, cache, raws = setup
    eng = engine.StateDictEngine({k: v.clone() for k, v in pub.states[0].items()}, 0)
    m1 = read_manifest(pub.store, RUN, 1, signing_key=KEY)
    # a node cache whose shard bytes were altered after verification (disk rot): the engine must refuse
    bad = ShardCache(tmp_path / "bad")
    for s in m1.shards:
        data = bytearray(cache.read(s.sha256))
        data[len(data) // 2] ^= 0xFF
        bad.put_verified(s.sha256, data)
    server = ControlServer(eng, port=0).start()
    try:
        with pytest.raises((DeltaError, ValueError)):
            stage_from_cache(RemoteAdapter(server.url), raws[1], bad.root)
        assert eng.version == 0
        assert_same(eng.state_dict(), pub.states[0])
    finally:
        server.close()


def test_remote_adapter_rejects_a_non_http_url():
    with pytest.raises(ValueError, match="http://"):
        RemoteAdapter("unix:///tmp/engine.sock")


def test_remote_adapter_reads_dynamos_error_envelope():
    """Dynamo's system server cannot choose a status: a failed route is a 500 with the exception in
    ``message``. The client still raises the engine's own error type with its text."""
    import http.server
    import threading

    from syncd.errors import ManifestError

    class H(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            body = json.dumps({"error": "Handler error",
                               "message": "Python callback failed: ManifestError: bad schema\nline 2"}).encode()
            self.send_response(500)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        with pytest.raises(ManifestError, match="bad schema\nline 2"):
            RemoteAdapter(f"http://127.0.0.1:{srv.server_port}").call("stage", {})
    finally:
        srv.shutdown()


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
