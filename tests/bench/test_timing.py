"""bench._timing, the benchmarks' one timer: warm-up and set-up calls are not timed, device syncs bracket the
clock, paired runs give per-round ratios, laps add up to the elapsed time."""

from __future__ import annotations

from bench import _timing


def test_only_the_timed_calls_count_and_setup_runs_before_each():
    calls, setups, syncs = [], [], []
    ts = _timing.times(lambda: calls.append(1), 3, setup=lambda: setups.append(1), warmup=2,
                       sync=lambda: syncs.append(1))
    assert len(ts) == 3 and len(calls) == 5 and len(setups) == 5 and len(syncs) == 10
    assert all(t >= 0 for t in ts)
    assert _timing.best_time(lambda: None, 4) <= _timing.median_time(lambda: sum(range(10000)), 4)


def test_paired_runs_the_baseline_before_the_call_in_every_round():
    order = []
    t, ratio = _timing.paired(lambda: order.append("fn"), lambda: order.append("base"), 3, warmup=1)
    assert order == ["fn", "base"] + ["base", "fn"] * 3
    assert t >= 0 and ratio > 0


def test_laps_add_up_and_medians_of_nothing_are_nan():
    sw = _timing.Stopwatch()
    laps = [sw.lap() for _ in range(3)]
    assert all(x >= 0 for x in laps) and sum(laps) <= sw.elapsed
    assert _timing.median([]) != _timing.median([])  # NaN
    assert _timing.median([3, 1, 2]) == 2
