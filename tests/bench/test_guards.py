"""The headline figures are guarded: each paired ratio, recomputed at a small size (``bench/_guards.py``), stays above
its stated fraction of the value committed in ``docs/results/guards.json``; the committed headline results are there
and small; and the guard fails, naming the figure, the committed value and the fraction, when a ratio is forced
down (a stubbed rate, and a really slowed format 2 encode)."""

from __future__ import annotations

import json

import pytest

from bench import _guards as g
from bench import guards

COMMITTED = g.load_committed()
HEADLINE_FILES = ("codec", "engine_update", "replay", "broadcast")


@pytest.mark.parametrize("group", ["codec", "engine", "replay",
                                   pytest.param("broadcast", marks=[pytest.mark.integration, pytest.mark.slow])])
def test_the_headline_ratio_holds_its_committed_fraction(group):
    got, failed = g.guard(group, COMMITTED)
    if "_skipped" in got:
        pytest.skip(got["_skipped"])
    assert not failed, "\n".join(failed)
    assert {k for k in got if not k.startswith("_")} == {k for k, v in g.OF_GROUP.items() if v == group}


def test_the_committed_results_are_there_small_and_say_how_they_were_made():
    for name in HEADLINE_FILES:
        path = g.RESULTS / f"{name}.json"
        assert path.stat().st_size < 16_000, f"{path}: strip the per-round arrays"
        doc = json.loads(path.read_text())
        assert doc["command"].startswith(f"python -m bench.{name}") and "load average" in doc["load_before"]
    assert set(COMMITTED) == set(g.FIGURES)
    for name, c in COMMITTED.items():
        assert c["committed"] > 0 and 0 < c["fraction"] <= 0.8, name
        assert c["fraction"] == g.fraction_from_spread(c["runs"]), f"{name}: the fraction follows the stated rule"
        assert c["headline"]["value"] > 0, f"{name}: its headline value is committed beside it"
    assert {k: v for k, v in guards.headline_values().items() if v is None} == {}


def _slowed(factor: float):
    """A measurement giving every figure ``factor`` x its committed value, in every round."""
    def measure(group):
        figs = {k: COMMITTED[k]["committed"] * factor for k, v in g.OF_GROUP.items() if v == group}
        return {**{k: (v, [v] * 5) for k, v in figs.items()}, "_size": "stub"}
    return measure


def test_the_guard_fails_on_a_stubbed_slow_rate_naming_figure_committed_value_and_fraction():
    calls = []
    stub = _slowed(0.3)

    def measure(group):
        calls.append(group)
        return stub(group)
    got, failed = g.guard("replay", COMMITTED, measure_fn=measure)
    assert calls == ["replay", "replay"], "measured again before failing"
    c = COMMITTED["replay_naive_vs_op"]
    assert len(failed) == 1
    msg = failed[0]
    assert msg.startswith("replay_naive_vs_op ") and f"{c['committed']:.3g}x" in msg and f"{c['fraction']:g} x" in msg
    assert f"measured {0.3 * c['committed']:.3g}x" in msg
    # at the committed value it holds, measured once
    calls.clear()
    assert g.guard("replay", COMMITTED, measure_fn=lambda grp: calls.append(grp) or _slowed(1.0)(grp))[1] == []
    assert calls == ["replay"]


def test_the_check_command_exits_1_and_names_the_figure(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(g, "measure", _slowed(0.3))
    assert guards.main(["--groups", "codec", "--json", str(tmp_path / "g.json")]) == 1
    err = capsys.readouterr().err
    assert "GUARD FAILED: codec_encode_v2_vs_v1" in err and "GUARD FAILED: codec_apply_v2_vs_v1" in err
    out = json.loads((tmp_path / "g.json").read_text())
    assert out["figures"]["codec_encode_v2_vs_v1"]["ok"] is False
    monkeypatch.setattr(g, "measure", _slowed(1.0))
    assert guards.main(["--groups", "codec,engine", "--json", str(tmp_path / "g.json")]) == 0


def test_the_guard_fails_on_a_really_slowed_format_2_encode(monkeypatch):
    """A deliberately slowed build: format 2's encode does its work three times; the paired rounds see it."""
    from syncd.ops import delta

    real = delta.encode_many

    def slow(olds, news, **kw):
        for _ in range(2 if kw.get("version") == 2 else 0):
            real(olds, news, **kw)
        return real(olds, news, **kw)
    monkeypatch.setattr(delta, "encode_many", slow)
    got, failed = g.guard("codec", COMMITTED, attempts=1)
    assert any(m.startswith("codec_encode_v2_vs_v1 ") for m in failed), (got, failed)
