"""syncd.engines.client.RemoteAdapter driving a real engine (syncd.engine.StateDictEngine) through the control routes of
a real loopback HTTP server (syncd.engine.control_server), and reading Dynamo's error envelope."""

from __future__ import annotations

import http.client
import json

import pytest

from syncd import engine
from syncd.engine.control_server import ControlServer
from syncd.cache import ShardCache
from syncd.engines.client import RemoteAdapter
from syncd.engines.errors import EngineUnreachable
from syncd.engines.protocol import Adapter
from syncd.engines.update import Update
from syncd.errors import DeltaError
from syncd.versions import read_manifest
from tests.daemon.conftest import KEY, RUN, free_port
from tests.engines._published import setup  # noqa: F401 (the fixture)
from tests.store._models import assert_same


def test_remote_adapter_over_a_real_server(setup):
    pub, cache, raws = setup
    eng = engine.StateDictEngine(pub.zeros(), None)
    server = ControlServer(eng, port=free_port()).start()
    try:
        remote = RemoteAdapter(server.url)
        assert isinstance(remote, Adapter)
        assert remote.version is None
        assert list(remote.parameters()) == list(eng.parameters())
        remote.pause()
        remote.load_full(Update.from_cache(raws[0], cache.root))
        remote.stage(Update.from_cache(raws[1], cache.root))
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
            remote.stage(Update.from_cache(raws[1], cache.root))
        with pytest.raises(ValueError, match="node cache"):  # an update held in memory cannot cross the wire
            remote.stage(Update(version=2, kind="delta", tensors={}))
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
            RemoteAdapter(server.url).stage(Update.from_cache(raws[1], bad.root))
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
