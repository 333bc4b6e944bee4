"""bench.netsim's S3 endpoint over a file store: read-only by default; writable, it takes a publisher's
single-request PUTs (create-if-absent answered 412 when the key exists), DeleteObjects and DELETE, and refuses
multipart uploads and paths that leave the store -- through the same obstore client the product uses."""

from __future__ import annotations

import threading

import pytest

from bench.netsim import S3FileServer, s3_env
from syncd.errors import ObjectExists, StoreError
from syncd.store import RetryPolicy, Store


def _serve(root, writable: bool):
    srv = S3FileServer(root, "127.0.0.1", 0, writable=writable)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


@pytest.fixture
def served(tmp_path, monkeypatch):
    for k, v in s3_env().items():
        monkeypatch.setenv(k, v)
    made = []

    def make(writable: bool, **kw):
        srv = _serve(tmp_path / "store", writable)
        made.append(srv)
        return Store("s3://simstore", endpoint=f"http://127.0.0.1:{srv.server_address[1]}", **kw)

    (tmp_path / "store").mkdir()
    yield make
    for srv in made:
        srv.shutdown()
        srv.server_close()


def test_writable_endpoint_takes_puts_and_deletes(served, tmp_path):
    st = served(True, part_bytes=1 << 30)
    st.put("runs/r/a.bin", b"hello")
    st.put("runs/r/a.bin", b"hello again")  # overwrite
    with pytest.raises(ObjectExists):
        st.put("runs/r/a.bin", b"x", create=True)
    st.put("runs/r/b.bin", b"b" * 100_000, create=True)
    assert st.get("runs/r/a.bin") == b"hello again" and (tmp_path / "store/runs/r/b.bin").stat().st_size == 100_000
    assert sorted(o.key for o in st.list("runs/r/")) == ["runs/r/a.bin", "runs/r/b.bin"]
    assert not [p for p in (tmp_path / "store/runs/r").iterdir() if p.name.startswith(".")], "no temporary left"
    st.delete(["runs/r/a.bin", "runs/r/missing"])
    assert [o.key for o in st.list("runs/r/")] == ["runs/r/b.bin"]


def test_multipart_and_escaping_paths_are_refused(served, tmp_path):
    st = served(True, part_bytes=5 << 20, retry=RetryPolicy(attempts=1, http_retries=0))
    with pytest.raises(StoreError):
        st.put("runs/r/big.bin", b"x" * (6 << 20))  # over part_bytes: a multipart upload, not implemented here
    with pytest.raises(StoreError):
        st.put("runs/.hidden/x", b"x")
    assert not (tmp_path / "store/runs/r/big.bin").exists()


def test_read_only_by_default(served):
    st = served(False)
    with pytest.raises(StoreError):
        st.put("runs/r/a.bin", b"x")
