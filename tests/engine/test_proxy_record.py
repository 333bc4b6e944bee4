"""``syncd.engine.proxy.record``: trajectory records, their keys, and hostile-input checks."""

from __future__ import annotations

import json

import pytest

from syncd.engine.proxy.record import RecordError, Trajectory, Turn, record_key
from syncd.records.trajectory import list_records, parse, read_record
from syncd.store import Store


def _traj() -> Trajectory:
    t = Trajectory("run-1", "sb-1", "traj-1", metadata={"reward": 1.0})
    a = Turn(0, "chat/completions", {"messages": []}, True, status="ok", prompt_token_ids=[1, 2],
             output_token_ids=[5, 6, 7], versions=[3, 3, 4], logprobs=[-0.1, -0.2, -0.3], finish_reason="length",
             segments=[{"request_id": "r", "start": 0, "count": 2}, {"request_id": "r", "start": 2, "count": 1}])
    t.turns.append(a)
    return t


def test_round_trip_through_a_real_store(tmp_path):
    store = Store(tmp_path.as_uri())
    t = _traj()
    assert t.status == "complete" and t.failure is None
    store.put(t.key, t.encode(), create=True)
    doc = read_record(store, "run-1", "sb-1", "traj-1")
    assert doc["turns"][0]["versions"] == [3, 3, 4] and doc["metadata"] == {"reward": 1.0}
    assert list_records(store, "run-1") == [("sb-1", "traj-1")]
    assert t.key == record_key("run-1", "sb-1", "traj-1") == "runs/run-1/trajectories/sb-1/traj-1.json"


def test_a_failed_turn_fails_the_trajectory_with_its_reason():
    t = _traj()
    t.turns.append(Turn(1, "completions", {}, False))
    assert t.status == "failed" and "running" in t.failure  # never silently complete
    t.turns[1].fail("upstream failed after 3 tokens: boom")
    t.turns[1].fail("a later reason does not replace the first")
    assert t.failure == "turn 1: upstream failed after 3 tokens: boom"
    doc = parse(t.encode())
    assert doc["status"] == "failed" and doc["turns"][1]["error"].startswith("upstream failed")


def _mutate(fn) -> bytes:
    doc = json.loads(_traj().encode())
    fn(doc)
    return json.dumps(doc).encode()


@pytest.mark.parametrize("fn, what", [
    (lambda d: d.update(schema="other"), "not a syncd.trajectory"),
    (lambda d: d.update(schema_version=3), "schema_version"),
    (lambda d: d.update(run_id="../x"), "run_id"),
    (lambda d: d.update(status="great"), "status"),
    (lambda d: d["turns"][0].update(versions=[3, 3]), "one version"),
    (lambda d: d["turns"][0].update(output_token_ids=[5, "6", 7]), "integers"),
    (lambda d: d["turns"][0].update(index=4), "out of order"),
    (lambda d: d["turns"][0]["segments"].pop(), "segments"),
    (lambda d: d["turns"][0]["segments"][0].update(count="2"), "segments must be objects with a count"),
    (lambda d: d["turns"][0]["segments"][0].update(count=True), "segments must be objects with a count"),
    (lambda d: d["turns"][0]["segments"][0].update(count=2.0), "segments must be objects with a count"),
    (lambda d: d["turns"][0]["segments"].append(-1), "segments must be objects with a count"),
    (lambda d: d["turns"][0]["segments"].append({"count": -1}), "segments must be objects with a count"),
    (lambda d: d.update(status="failed"), "contradicts"),
])
def test_hostile_records_are_refused(fn, what):
    with pytest.raises(RecordError, match=what):
        parse(_mutate(fn))
    with pytest.raises(RecordError, match="not JSON"):
        parse(b"{nope")
    with pytest.raises(RecordError, match="not JSON"):
        parse(b'{"x": NaN}')


def test_ids_are_checked():
    with pytest.raises(RecordError, match="sandbox id"):
        record_key("run", "a/b", "t")
    with pytest.raises(RecordError, match="trajectory id"):
        record_key("run", "sb", "..")
