"""``engine.proxy.turn``: what the frontend sends is checked before it enters a record -- a malformed or
non-strict event, ``engine_data`` or choice fails the turn with the reason, never a record that cannot be
encoded or read back."""

from __future__ import annotations

import json

import pytest

from engine.proxy.record import Turn
from engine.proxy.sse import format_event
from engine.proxy.turn import BadRequest, Broken, TurnState, annotation_ids, parse_body, parse_event


def _state() -> TurnState:
    return TurnState(Turn(0, "completions", {}, True))


@pytest.mark.parametrize("data, why", [
    ('{"choices": [], "x": NaN}', "NaN is not a JSON value"),
    ("[" * 100 + "]" * 100, "nested deeper than 64"),
    ("[1]", "not a JSON object"),
    ('{"usage": [1]}', "malformed usage"),
])
def test_malformed_upstream_events_break_the_turn(data, why):
    with pytest.raises(Broken, match=why):
        parse_event(data)


@pytest.mark.parametrize("ed", [
    {"syncd": 1, "token_ids": ["5"], "versions": [0], "logprobs": [-0.1], "request_id": "r", "index": 0},
    {"syncd": 1, "token_ids": [5], "versions": ["0"], "logprobs": [-0.1], "request_id": "r", "index": 0},
    {"syncd": 1, "token_ids": [5], "versions": [0], "logprobs": [float("-inf")], "request_id": "r", "index": 0},
    {"syncd": 1, "token_ids": [5], "versions": [0], "logprobs": [-0.1], "request_id": "r", "index": True},
])
def test_engine_data_the_record_could_not_hold_is_refused(ed):
    st = _state()
    with pytest.raises(Broken, match="malformed engine_data"):
        st.add_engine_data(ed)
    assert st.turn.output_token_ids == [] and st.turn.versions == []
    st.add_engine_data({**ed, "token_ids": [5], "versions": [None], "logprobs": [-0.5], "index": 0})
    assert st.turn.output_token_ids == [5] and json.dumps(st.turn.to_json(), allow_nan=False)


def test_malformed_choices_and_annotations():
    st = _state()
    with pytest.raises(Broken, match="malformed choices"):
        st.add_choices({"choices": [{"index": 0, "text": 5}]}, chat=False)
    with pytest.raises(Broken, match="malformed choices"):
        st.add_choices({"choices": [{"delta": {"tool_calls": [{"function": {"name": 1}}]}}]}, chat=True)
    st.add_choices({"choices": [{"index": 0, "text": "ok", "finish_reason": "length"}]}, chat=False)
    assert st.turn.text == "ok" and st.turn.finish_reason == "length"
    assert annotation_ids('"[1,2]"') == [1, 2]
    with pytest.raises(Broken, match="token_ids"):
        annotation_ids("[[[1]]]")


def test_bodies_and_a_lone_surrogate():
    assert parse_body(b'{"prompt": "\\ud800"}', max_bytes=100) == {"prompt": "\ud800"}
    with pytest.raises(BadRequest, match="'nvext.annotations' must be a list of strings"):
        parse_body(b'{"nvext": {"annotations": "token_ids"}}', max_bytes=100)
    # a lone surrogate is valid in a JSON escape but not in UTF-8: the event carries the escape
    assert format_event({"text": "\ud800"}) == b'data: {"text":"\\ud800"}\n\n'
