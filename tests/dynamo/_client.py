"""A tiny blocking OpenAI-style HTTP client for the tests: whole responses and SSE streams read event by
event (so a test can act in the middle of a stream)."""

from __future__ import annotations

import http.client
import json
from urllib.parse import urlsplit


def _conn(url: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    u = urlsplit(url)
    return http.client.HTTPConnection(u.hostname, u.port, timeout=timeout), u.path or "/"


def post_json(url: str, body: dict, *, headers: dict | None = None, timeout: float = 120.0):
    """``(status, headers, parsed JSON body)``."""
    conn, path = _conn(url, timeout)
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json",
                                                                   **(headers or {})})
        resp = conn.getresponse()
        raw = resp.read()
        return resp.status, dict(resp.getheaders()), json.loads(raw) if raw else None
    finally:
        conn.close()


def get_json(url: str, *, timeout: float = 30.0):
    conn, path = _conn(url, timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        raw = resp.read()
        return resp.status, json.loads(raw) if raw else None
    finally:
        conn.close()


def post_stream(url: str, body: dict, *, headers: dict | None = None, on_event=None, timeout: float = 120.0,
                stop_after: int | None = None):
    """POST with ``stream: true``; returns ``(status, headers, events)`` where events are the parsed JSON
    ``data:`` objects (without ``[DONE]``). ``on_event(i, obj)`` is called for each. ``stop_after``: close
    the connection after that many events (a client that goes away)."""
    conn, path = _conn(url, timeout)
    events = []
    try:
        conn.request("POST", path, body=json.dumps({**body, "stream": True}),
                     headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        hdrs = dict(resp.getheaders())
        if resp.status != 200:
            raw = resp.read()
            return resp.status, hdrs, [json.loads(raw)] if raw else []
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                break
            obj = json.loads(data)
            events.append(obj)
            if on_event is not None:
                on_event(len(events) - 1, obj)
            if stop_after is not None and len(events) >= stop_after:
                break
        return resp.status, hdrs, events
    finally:
        conn.close()


def stream_text(events: list, chat: bool) -> str:
    out = []
    for ev in events:
        for ch in ev.get("choices") or []:
            out.append((ch.get("delta") or {}).get("content") or "" if chat else ch.get("text") or "")
    return "".join(out)


def finish_reason(events: list):
    for ev in reversed(events):
        for ch in ev.get("choices") or []:
            if ch.get("finish_reason"):
                return ch["finish_reason"]
    return None
