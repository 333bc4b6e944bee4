"""An engine that serves while a controller thread applies versions to it (the reference engine's serving tests):
:func:`serve_while_updating` runs it, :func:`check_served` checks what came out: no request lost or restarted, and
the tokens after each apply carry the new version."""

from __future__ import annotations

import threading


def serve_while_updating(eng, requests, versions: int, stage, check, *, first=None, timeout: float = 120.0):
    """Submit ``requests`` to ``eng`` and, on a controller thread, for each version ``v`` in ``1..versions``: let a
    few tokens go out, ``stage(v)`` while serving, pause, apply, check that the engine is at ``v`` and
    ``check(v)`` (still paused: no token may come meanwhile), resume. ``first()``, when given, runs on the controller
    before the first version. Closes ``eng``. Returns ``(events in generation order, {version: events generated
    before its apply})``."""
    events: list = []  # appended by the scheduler thread only, in generation order
    finished = threading.Event()

    def sink(ev):
        events.append(ev)
        if ev.finish_reason and sum(e.finish_reason is not None for e in events) == len(requests):
            finished.set()

    boundaries, errors = {}, []

    def controller():
        try:
            if first is not None:
                first()
            for v in range(1, versions + 1):
                want_tokens = len(events) + 6  # let some tokens of the previous version go out first
                while len(events) < want_tokens and not finished.is_set():
                    finished.wait(0.01)
                stage(v)  # while serving
                eng.pause()
                boundaries[v] = len(events)
                eng.apply()
                assert eng.version == v
                check(v)
                assert len(events) == boundaries[v]  # nothing ran while paused
                eng.resume()
        except BaseException as exc:  # surfaced by the main thread
            errors.append(exc)
            eng.resume()

    try:
        for r in requests:
            eng.submit(r, sink)
        t = threading.Thread(target=controller)
        t.start()
        t.join(timeout)
        assert not t.is_alive(), f"controller did not finish its updates within {timeout:.0f} s"
        assert not errors, errors
        assert finished.wait(timeout), f"requests did not finish within {timeout:.0f} s"
    finally:
        eng.close()
    return events, boundaries


def check_served(events, boundaries, requests, versions: int) -> dict:
    """No request lost or restarted (each one's ``max_tokens``, then ``length``), versions never going back, tokens
    after each apply of the new version (or newer), every version served, some request across an update. Returns
    the events by request id."""
    by_req: dict = {}
    for e in events:
        by_req.setdefault(e.request_id, []).append(e)
    assert sorted(by_req) == sorted(r.request_id for r in requests)
    for r in requests:
        evs = by_req[r.request_id]
        assert [e.index for e in evs] == list(range(r.sampling.max_tokens)), r.request_id  # none dropped or restarted
        assert evs[-1].finish_reason == "length" and all(e.finish_reason is None for e in evs[:-1])
        assert [e.version for e in evs] == sorted(e.version for e in evs)
    # tokens before an apply carry older versions, tokens after it the new one (or newer)
    for v, b in boundaries.items():
        assert all(e.version < v for e in events[:b]) and all(e.version >= v for e in events[b:])
    assert len({e.version for e in events}) == versions + 1
    assert any(len({e.version for e in evs}) > 1 for evs in by_req.values())  # requests spanned updates
    return by_req
