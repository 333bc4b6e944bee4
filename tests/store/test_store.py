"""syncd.store on real backends: local files, memory, and S3, GCS and Azure servers on loopback (moto,
fake-gcs-server, Azurite)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from syncd.errors import IntegrityError, ObjectExists, ObjectNotFound, StoreError
from syncd.store import RetryPolicy, Store, default_url, resolve_url

from .conftest import NO_CONDITIONAL_GET, FlakyProxy, gcs_store


def test_put_get_roundtrip_and_listing(any_store):
    data = os.urandom(300_000)  # several 64 KiB parts: a parallel ranged download
    any_store.put("runs/r/versions/000000000001/shards/a", data)
    any_store.put("runs/r/versions/000000000002/manifest.json", b"{}")
    any_store.put("runs/q/latest.json", b"1")
    assert bytes(any_store.download("runs/r/versions/000000000001/shards/a")) == data
    assert any_store.get("runs/r/versions/000000000002/manifest.json") == b"{}"
    assert any_store.get_range("runs/r/versions/000000000001/shards/a", 1000, 1010) == data[1000:1010]
    assert any_store.list_dirs("runs/") == ["q", "r"]
    assert any_store.list_dirs("runs/r/versions") == ["000000000001", "000000000002"]
    assert sorted(o.key for o in any_store.list("runs/r/")) == [
        "runs/r/versions/000000000001/shards/a", "runs/r/versions/000000000002/manifest.json"]
    info = any_store.head("runs/r/versions/000000000001/shards/a")
    assert info.size == len(data) and info.last_modified.tzinfo is not None
    assert any_store.list("nothing/") == [] and any_store.list_dirs("nothing/") == []


def test_missing_objects_raise_object_not_found(any_store):
    for call in (lambda: any_store.get("no/such"), lambda: any_store.download("no/such"),
                 lambda: any_store.head("no/such")):
        with pytest.raises(ObjectNotFound, match="no/such does not exist"):
            call()
    assert not any_store.exists("no/such")


def test_delete_ignores_missing_keys(any_store):
    any_store.put("a/1", b"x")
    any_store.put("a/2", b"y")
    any_store.delete(["a/1", "a/missing", "a/2"])
    assert any_store.list("a/") == []
    any_store.delete("a/1")  # already gone: fine


def test_create_if_absent_refuses_second_writer_and_keeps_the_first(any_store):
    any_store.put("v/manifest.json", b"first", create=True)
    with pytest.raises(ObjectExists, match="already exists"):
        any_store.put("v/manifest.json", b"second", create=True)
    assert any_store.get("v/manifest.json") == b"first"


def test_create_if_absent_race_has_exactly_one_winner(any_store):
    n = 8
    barrier = threading.Barrier(n)
    results = [None] * n

    def writer(i):
        barrier.wait()
        try:
            any_store.put("race/manifest.json", f"writer {i}".encode(), create=True)
            results[i] = "won"
        except ObjectExists:
            results[i] = "lost"

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results.count("won") == 1 and results.count("lost") == n - 1
    assert any_store.get("race/manifest.json") == f"writer {results.index('won')}".encode()


def test_conditional_get_returns_none_until_the_object_changes(any_store, request):
    if request.node.callspec.params["any_store"] in NO_CONDITIONAL_GET:
        pytest.skip("this emulator ignores If-None-Match (test_a_store_without_conditional_get_returns_the_body)")
    any_store.put("runs/r/latest.json", b'{"version": 1}')
    body, etag = any_store.get_if_changed("runs/r/latest.json", None)
    assert body == b'{"version": 1}' and etag
    assert any_store.get_if_changed("runs/r/latest.json", etag) is None
    any_store.put("runs/r/latest.json", b'{"version": 2, "x": 0}')
    changed = any_store.get_if_changed("runs/r/latest.json", etag)
    assert changed is not None and changed[0] == b'{"version": 2, "x": 0}' and changed[1] != etag


@pytest.mark.integration
def test_a_store_without_conditional_get_returns_the_body(fake_gcs):
    """fake-gcs-server ignores If-None-Match: get_if_changed then returns the object every time (a poll costs
    the hint's body, never a missed change)."""
    store = gcs_store(fake_gcs)
    store.put("runs/r/latest.json", b'{"version": 1}')
    body, etag = store.get_if_changed("runs/r/latest.json", None)
    assert store.get_if_changed("runs/r/latest.json", etag) == (body, etag)
    store.put("runs/r/latest.json", b'{"version": 2}')
    assert store.get_if_changed("runs/r/latest.json", etag)[0] == b'{"version": 2}'


def test_reads_can_be_bounded_against_hostile_objects(any_store):
    any_store.put("x", b"0123456789")
    assert any_store.get("x", limit=4) == b"0123"
    assert any_store.get("x", limit=100) == b"0123456789"
    with pytest.raises(IntegrityError, match="x is 10 bytes, expected 11"):
        any_store.download("x", expect_size=11)


def test_empty_object_downloads_as_empty(any_store):
    any_store.put("e", b"")
    assert bytes(any_store.download("e")) == b""


def test_url_resolution(tmp_path, monkeypatch):
    monkeypatch.delenv("SYNCD_STORE", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert default_url() == (tmp_path / "xdg" / "syncd" / "store").resolve().as_uri()
    assert resolve_url(None) == default_url()
    monkeypatch.setenv("SYNCD_STORE", "memory://from-env")
    assert resolve_url(None) == "memory://from-env"
    assert resolve_url(str(tmp_path / "p")) == (tmp_path / "p").as_uri()
    s = Store(tmp_path / "with space")  # a path becomes a file store, created on demand
    s.put("k", b"v")
    assert (tmp_path / "with space" / "k").read_bytes() == b"v"
    assert Store(s.url).get("k") == b"v"  # and its file:// URL (percent-encoded) names the same place
    assert Store.open(s) is s


def test_memory_urls_name_one_store_per_process():
    a, b = Store("memory://shared-name"), Store("memory://shared-name")
    a.put("k", b"v")
    assert b.get("k") == b"v"
    assert not Store("memory://other-name").exists("k")


def test_bad_urls_and_options_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="unsupported store URL scheme 'ftp'"):
        Store("ftp://host/x")
    with pytest.raises(ValueError, match="store endpoint 'localhost:4443' .* must be a URL with a scheme"):
        Store("gs://bucket/x", endpoint="localhost:4443")
    with pytest.raises(ValueError, match="cannot open store"):
        Store("s3://bucket/x", options={"no_such_option": "1"})


def test_large_object_multipart_upload_on_local_store(tmp_path):
    store = Store(tmp_path, part_bytes=1 << 20)
    data = os.urandom((5 << 20) + 12345)  # over the 5 MiB part minimum: a multipart upload
    store.put("big", data)
    assert Path(tmp_path, "big").read_bytes() == data
    assert bytes(store.download("big")) == data


@pytest.mark.integration
def test_s3_multipart_upload_and_parallel_ranged_download(s3_url):
    store = Store(s3_url, part_bytes=1 << 20, concurrency=4)
    data = os.urandom((6 << 20) + 7)  # 2 multipart parts up, 7 ranged parts down
    store.put("big/object", data)
    assert store.head("big/object").size == len(data)
    assert bytes(store.download("big/object")) == data


@pytest.mark.integration
def test_s3_explicit_endpoint_flag_overrides_env(s3_endpoint, s3_url, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # wrong on purpose: nothing listens there
    store = Store(s3_url, endpoint=s3_endpoint)
    store.put("k", b"v")
    assert store.get("k") == b"v"


@pytest.mark.integration
def test_transient_connection_resets_are_retried(s3_endpoint, s3_url):
    proxy = FlakyProxy(int(s3_endpoint.rsplit(":", 1)[1]), drop=2)
    try:
        store = Store(s3_url, endpoint=f"http://127.0.0.1:{proxy.port}",
                      retry=RetryPolicy(attempts=3, initial_backoff_s=0.01, http_retries=1, retry_timeout_s=20))
        store.put("flaky/k", b"payload", create=True)  # the first connections are reset
        assert proxy.accepted >= 3
        assert store.get("flaky/k") == b"payload"
    finally:
        proxy.close()


@pytest.mark.integration
def test_unreachable_store_fails_with_store_error_after_retries(s3_url):
    from tests.store.conftest import free_port

    store = Store(s3_url, endpoint=f"http://127.0.0.1:{free_port()}",
                  retry=RetryPolicy(attempts=2, initial_backoff_s=0.01, max_backoff_s=0.05, http_retries=1,
                                    retry_timeout_s=2))
    with pytest.raises(StoreError, match="failed after 2 attempts"):
        store.get("anything")


def test_gcs_and_azure_urls_open_through_obstore():
    # the URLs reach obstore's GCS and Azure stores (no request made; the emulators: any_store)
    gs = Store("gs://bucket/prefix", options={"skip_signature": True})
    az = Store("az://container/prefix", options={"account_name": "acct", "skip_signature": True})
    assert type(gs.raw).__name__ == "GCSStore" and type(az.raw).__name__ == "AzureStore"


def test_get_bounded_refuses_a_large_object_without_reading_it(any_store):
    from syncd.errors import ObjectTooLarge

    any_store.put("small", b"x" * 100)
    any_store.put("empty", b"")
    any_store.put("large", b"y" * 300_000)
    assert any_store.get_bounded("small", 100) == b"x" * 100 and any_store.get_bounded("empty", 10) == b""
    with pytest.raises(ObjectTooLarge, match="large is 300000 bytes, over the 1000-byte limit"):
        any_store.get_bounded("large", 1000)
    with pytest.raises(ObjectNotFound):
        any_store.get_bounded("missing", 10)


@pytest.mark.integration
def test_azurite_at_its_own_address_through_use_emulator(azurite, monkeypatch):
    from . import _emulators

    container = _emulators.azure_container(azurite.port)
    monkeypatch.setenv("AZURITE_BLOB_STORAGE_URL", f"http://127.0.0.1:{azurite.port}")  # read by obstore
    store = Store(f"az://{container}/p", options={"use_emulator": "true"})
    store.put("k", b"v", create=True)
    assert store.get("k") == b"v" and [o.key for o in store.list("")] == ["k"]


@pytest.mark.integration
@pytest.mark.parametrize("backend", ["gcs", "azure"])
def test_the_cli_reaches_an_emulator_with_endpoint_and_store_options(backend, request, capsys):
    from syncd.app.cli import main as cli

    from . import _emulators
    from .conftest import azure_store

    if backend == "gcs":
        store = gcs_store(request.getfixturevalue("fake_gcs"))
        endpoint, options = request.getfixturevalue("fake_gcs")[1].url, ["bearer_token=emulator"]
    else:
        azurite = request.getfixturevalue("azurite")
        store = azure_store(azurite)
        endpoint = f"http://127.0.0.1:{azurite.port}/{_emulators.AZURITE_ACCOUNT}"
        options = [f"account_name={_emulators.AZURITE_ACCOUNT}", f"access_key={_emulators.AZURITE_KEY}"]
    store.put("runs/r1/versions/000000000000/manifest.json", b"{}")
    argv = ["ls", "--store", store.url, "--endpoint", endpoint] + [f"--store-option={o}" for o in options]
    assert cli(argv) == 0
    assert capsys.readouterr().out == "r1\n"
