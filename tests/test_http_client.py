"""syncd.http_client against a real HTTP server on loopback: JSON both ways, a prefix in the URL, a plain-text error,
a reply over the limit, a server that is not there, one that drops the connection, one that never answers."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from syncd import http_client
from syncd.procs import free_port


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _reply(self, status: int, body: bytes, ctype: str = "application/json"):
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        n = int(self.headers.get("Content-Length", 0))
        sent = json.loads(self.rfile.read(n)) if n else None
        self._reply(200, json.dumps({"path": self.path, "sent": sent, "auth": self.headers.get("X-Auth")}).encode())

    def do_GET(self):
        if self.path.endswith("/text"):
            self._reply(503, b"upstream is down", "text/plain")
        elif self.path.endswith("/big"):
            self._reply(200, b"x" * 5000, "text/plain")
        elif self.path.endswith("/drop"):
            self.connection.shutdown(socket.SHUT_RDWR)
        elif self.path.endswith("/empty"):
            self._reply(204, b"")
        else:
            self._reply(200, b'{"ok": true}')


@pytest.fixture(scope="module")
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_json_both_ways_with_the_urls_prefix_and_headers(server):
    status, reply = http_client.request_json("POST", server + "/api/", "/v1/x", {"a": [1, 2]},
                                             headers={"X-Auth": "t"})
    assert status == 200 and reply == {"path": "/api/v1/x", "sent": {"a": [1, 2]}, "auth": "t"}
    assert http_client.request_json("GET", server, "/") == (200, {"ok": True})
    assert http_client.request_json("GET", server, "/empty") == (204, None)


def test_a_plain_text_error_is_returned_with_its_status(server):
    assert http_client.request_json("GET", server, "/text") == (503, "upstream is down")


def test_a_reply_over_the_limit_is_refused(server):
    assert len(http_client.request("GET", server, "/big", max_reply_bytes=5000).body) == 5000
    with pytest.raises(http_client.ReplyTooLarge, match="over 4999 bytes"):
        http_client.request("GET", server, "/big", max_reply_bytes=4999)


def test_nothing_listening_a_dropped_connection_and_silence_are_unreachable(server):
    with pytest.raises(http_client.Unreachable, match="not answering") as info:
        http_client.request("GET", f"http://127.0.0.1:{free_port()}", "/")
    assert isinstance(info.value, ConnectionError)
    with pytest.raises(http_client.Unreachable, match="GET failed"):
        http_client.request("GET", server, "/drop")
    with socket.socket() as silent:  # accepts (the kernel's backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        with pytest.raises(http_client.Unreachable, match="timed out|TimeoutError"):
            http_client.request("GET", f"http://127.0.0.1:{silent.getsockname()[1]}", "/", timeout_s=0.3)


@pytest.mark.parametrize("url", ["127.0.0.1:8000", "ftp://h/", "http://", "http://h:99999", "http://h/?q=1", None])
def test_a_url_that_cannot_be_an_http_base_is_refused_by_name(url):
    with pytest.raises(ValueError, match="replica server URL"):
        http_client.split_url(url, "replica server URL")
