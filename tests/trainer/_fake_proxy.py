"""A small HTTP server standing in for ``syncd.engine.proxy`` in unit tests of the trainer's client side (the real proxy,
in front of real Dynamo engines, is in test_loop_e2e.py): ``GET /v1/models`` lists ``models``; ``POST
/v1/completions`` answers ``status`` with an 8-token completion and records the request; ``POST
/syncd/trajectories/<id>/finish`` records the metadata and answers a written, complete record of run ``rl``."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class ProxyHandler(BaseHTTPRequestHandler):
    """What the proxy stand-ins share: JSON replies (:meth:`_reply`), ``GET /v1/models`` listing
    :meth:`model_ids`, no request log."""

    def model_ids(self):
        return ["tiny"]

    def _reply(self, code, obj):
        raw = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self):
        if self.path != "/v1/models":
            return self._reply(404, {"error": "not found"})
        self._reply(200, {"object": "list", "data": [{"id": m} for m in self.model_ids()]})

    def log_message(self, *a):
        pass


def serve(handler: type[BaseHTTPRequestHandler]) -> tuple[ThreadingHTTPServer, str]:
    """A threading server for ``handler`` on a free local port, serving in a daemon thread; (server, its URL)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


class FakeProxy:
    def __init__(self, status: int = 200, models=("tiny",)):
        self.status, self.models, self.finished, self.requests = status, list(models), {}, []
        outer = self

        class Handler(ProxyHandler):
            def model_ids(self):
                return outer.models

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                if self.path == "/v1/completions":
                    outer.requests.append((self.headers["X-Syncd-Trajectory"], body))
                    if outer.status != 200:
                        return self._reply(outer.status, {"error": "boom"})
                    return self._reply(200, {"choices": [{"text": "aaaaaaaa", "finish_reason": "length"}],
                                             "usage": {"completion_tokens": 8}})
                tid = self.path.split("/")[3]
                outer.finished[tid] = body.get("metadata")
                self._reply(200, {"key": f"runs/rl/trajectories/sb/{tid}.json", "trajectory_id": tid,
                                  "status": "complete", "written": True})

        self.server, self.url = serve(Handler)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
