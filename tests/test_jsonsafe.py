"""``syncd.jsonsafe``: bounded, strict JSON -- the depth check agrees with a plain recursive count on random
documents full of brackets, quotes and backslashes inside strings, and every kind of hostile text gets the
named error, never a RecursionError or a value the strict encoder refuses."""

from __future__ import annotations

import json
import random

import pytest

from syncd.cluster import wire
from syncd.cluster.errors import ProtocolError
from syncd.jsonsafe import JSONError, loads, too_deep


def _depth(v) -> int:
    if isinstance(v, dict):
        return 1 + max(map(_depth, v.values()), default=0)
    if isinstance(v, list):
        return 1 + max(map(_depth, v), default=0)
    return 0


def _doc(rng: random.Random, depth: int):
    if depth == 0 or rng.random() < 0.2:
        return rng.choice([1, -2.5, None, True, "", "a[b", "}{", "\\", '"]', '\\"[', "ü[", "\u2028"])
    if rng.random() < 0.5:
        return [_doc(rng, depth - 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(["k", "[", '"{', "\\]"]) + str(i): _doc(rng, depth - 1) for i in range(rng.randint(0, 3))}


def test_depth_check_matches_a_recursive_count():
    rng = random.Random(7)
    for _ in range(2000):
        doc = _doc(rng, rng.randint(0, 14))
        text = json.dumps(doc, ensure_ascii=rng.random() < 0.5).encode()
        d = _depth(doc)
        for limit in (0, 1, 2, 5, 9, 14):
            assert too_deep(text, limit) == (d > limit), (text, limit, d)
        assert loads(text, what="x", max_bytes=1 << 20, max_depth=14) == doc


@pytest.mark.parametrize("text, why", [
    (b"[" * 4096 + b"]" * 4096, "nested deeper than 64"),
    (b"[" * 100_000, "nested deeper than 64"),
    (b'{"a": [' + b"{" * 70 + b"}" * 70 + b"]}", "nested deeper than 64"),
    (b'{"t": NaN}', "NaN is not a JSON value"),
    (b"[Infinity]", "Infinity is not a JSON value"),
    (b'{"x": -Infinity}', "-Infinity is not a JSON value"),
    (b"[1e999]", "overflows to infinity"),
    (b"[1, 2", "not valid JSON"),
    (b"\xff\xfe", "not UTF-8"),
    (b"1" * 5000, "over the limit"),
])
def test_hostile_text_gets_the_named_error(text, why):
    with pytest.raises(JSONError, match=why):
        loads(text, what="body", max_bytes=4096 if len(text) == 5000 else 1 << 20)


def test_what_a_caller_does_not_accept_and_its_own_error_class():
    with pytest.raises(ProtocolError, match="m: non-integer number '1.5'"):
        loads(b'{"a": 1.5}', what="m", max_bytes=100, floats=False, error=ProtocolError)
    with pytest.raises(JSONError, match="duplicate member 'a'"):
        loads(b'{"a": 1, "a": 2}', what="m", max_bytes=100, unique_members=True)
    assert loads(b'{"a": 1, "a": 2}', what="m", max_bytes=100) == {"a": 2}
    with pytest.raises(JSONError, match="not ASCII"):
        loads('["ü"]'.encode(), what="m", max_bytes=100, ascii_only=True)
    # what loads returns, the strict encoder writes back, nested in a few more levels
    value = loads(b'[' * 64 + b'"\\ud800", 1e308' + b']' * 64, what="m", max_bytes=1 << 10)
    json.dumps({"turns": [{"request": value}]}, allow_nan=False, ensure_ascii=True)


def test_cluster_messages_are_bounded():
    with pytest.raises(ProtocolError, match="HEARTBEAT: JSON nested deeper than 16"):
        wire.parse_json(b'{"hold": ' + b"[" * 17 + b"]" * 17 + b"}", "HEARTBEAT")
    with pytest.raises(ProtocolError, match="over the limit"):
        wire.parse_json(b'{"a": "' + b"x" * 5000 + b'"}', "latest.json", max_bytes=4096)
    assert wire.parse_json(b'{"a": [[1]]}', "PLAN") == {"a": [[1]]}
