"""``syncd.engine.proxy.procs.start_proxy`` in a reused workdir: the ready file an earlier proxy left behind never
answers for the new one (a real ``python -m syncd.engine.proxy`` process, a local-files store)."""

from __future__ import annotations

import json

from syncd.procs import http_json, stop_process
from syncd.engine.proxy.procs import start_proxy


def test_a_stale_ready_file_does_not_answer_for_the_new_proxy(tmp_path):
    stale = {"url": "http://127.0.0.1:1", "pid": 1}
    (tmp_path / "proxy-sb.json").write_text(json.dumps(stale))
    proc, url = start_proxy(tmp_path, "http://127.0.0.1:9", str(tmp_path / "store"), "run", "sb")
    try:
        assert url != stale["url"] and json.loads((tmp_path / "proxy-sb.json").read_text())["pid"] == proc.pid
        status, health = http_json("GET", f"{url}/health")
        assert status == 200 and health["ok"], health
    finally:
        assert stop_process(proc, 30) == 0
