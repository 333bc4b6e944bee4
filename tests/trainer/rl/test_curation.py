"""``syncd.trainer.rl.curation``: Beta pass-rate estimates and the difficulty filter, on synthetic pass rates whose
answers are known in closed form."""

from __future__ import annotations

import math
import random
import threading

import pytest

from syncd.trainer.rl.curation import (KEPT, TOO_EASY, TOO_HARD, CuratedTask, CurationConfig, CurationExhausted,
                                       Curator, beta_tail)
from syncd.trainer.rl.tasks import Sample, get_task


def _binomial_tail(x: float, a: int, b: int) -> float:
    """``P(Beta(a, b) <= x) = P(Binomial(a + b - 1, x) >= a)`` for integer ``a, b``."""
    n = a + b - 1
    return sum(math.comb(n, j) * x ** j * (1 - x) ** (n - j) for j in range(a, n + 1))


@pytest.mark.parametrize("x, a, b", [(0.05, 1, 1), (0.5, 3, 1), (0.3, 2, 7), (0.9, 10, 2), (0.5, 1, 5)])
def test_beta_tail_is_the_binomial_identity(x, a, b):
    assert beta_tail(x, a, b) == pytest.approx(_binomial_tail(x, a, b), rel=1e-12, abs=1e-15)
    assert beta_tail(0.0, a, b) == 0.0 and beta_tail(1.0, a, b) == 1.0


def test_always_solved_is_dropped_after_the_number_of_attempts_the_posterior_says():
    # uniform prior, n solves of n: P(p > 0.5) = 1 - 0.5 ** (n + 1) >= 0.9 first at n = 3
    cur = Curator(CurationConfig(band=(0.05, 0.5), confidence=0.9))
    for n in range(1, 5):
        cur.observe("t", [1.0])
        est = cur.estimate("t")
        assert est.above == pytest.approx(1 - 0.5 ** (n + 1))
        assert est.verdict == (TOO_EASY if n >= 3 else KEPT), n


def test_never_solved_is_dropped_when_the_mass_below_the_band_passes_confidence():
    # n failures of n: P(p < 0.05) = 1 - 0.95 ** (n + 1) >= 0.9 first at n + 1 = 45
    cur = Curator(CurationConfig(band=(0.05, 0.5), confidence=0.9, window=100))
    first = None
    for n in range(1, 60):
        cur.observe("t", [0.0])
        assert cur.estimate("t").below == pytest.approx(1 - 0.95 ** (n + 1))
        if first is None and cur.verdict("t") == TOO_HARD:
            first = n
    assert first == math.ceil(math.log(0.1) / math.log(0.95)) - 1 == 44


def test_tasks_inside_the_band_are_kept_and_outside_dropped_on_synthetic_pass_rates():
    rng = random.Random(7)
    rates = {"never": 0.0, "rare": 0.15, "half": 0.35, "often": 0.9, "always": 1.0}
    cur = Curator(CurationConfig(band=(0.05, 0.5), confidence=0.95, window=400))
    for name, p in rates.items():
        cur.observe(name, [float(rng.random() < p) for _ in range(400)])
    verdicts = {e.task_id: e.verdict for e in cur.estimates()}
    assert verdicts == {"never": TOO_HARD, "rare": KEPT, "half": KEPT, "often": TOO_EASY, "always": TOO_EASY}
    for e in cur.estimates():
        assert abs(e.mean - rates[e.task_id]) < 0.06  # 400 draws: a few standard errors


def test_the_window_re_estimates_a_task_the_policy_learnt():
    cur = Curator(CurationConfig(band=(0.05, 0.5), window=8))
    cur.observe("t", [0.0] * 3 + [1.0])
    assert cur.verdict("t") == KEPT
    cur.observe("t", [1.0] * 8)  # the policy improved: the old failures fall out of the window
    est = cur.estimate("t")
    assert (est.attempts, est.solved, est.verdict) == (8, 8, TOO_EASY)


def test_solved_at_is_the_reward_threshold():
    cur = Curator(CurationConfig(solved_at=0.75))
    cur.observe("t", [0.74, 0.75, 1.0, 0.2])
    assert (cur.estimate("t").attempts, cur.estimate("t").solved) == (4, 2)


@pytest.mark.parametrize("kw, field", [(dict(band=(0.5, 0.5)), "band"), (dict(prior=(0, 1)), "prior"),
                                       (dict(confidence=0.5), "confidence"), (dict(window=0), "window")])
def test_bad_configuration_names_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        CurationConfig(**kw)


def _run(task: CuratedTask, reward, draws: int, start: int = 0) -> list[int]:
    """Draws ``start ..`` and observes each item's reward, as the rollout workers do once a group is buffered."""
    seen = []
    for i in range(start, start + draws):
        item = task.item(i)
        seen.append(item.meta["curation"]["task_id"])
        task.observe(item, [reward(Sample(item, "x"))])
    return seen


def test_the_sampler_skips_dropped_tasks_counts_why_and_rechecks_them():
    base = get_task("repeat", length=4)
    task = CuratedTask(base, CurationConfig(band=(0.2, 0.8), pool=4, window=16, recheck_after=6))
    solved = {0: 1.0, 1: 0.0, 2: 1.0}  # task 3 solved one time in three (inside the band)
    calls = {3: 0}

    def reward(sample):
        k = sample.item.meta["curation"]["task_id"]
        if k == 3:
            calls[3] += 1
            return float(calls[3] % 3 == 0)
        return solved[k]

    seen = _run(task, reward, 28 * 8)
    assert seen[:4] == [0, 1, 2, 3]  # unseen tasks are kept
    st = task.stats()
    assert st["verdicts"] == {TOO_EASY: 2, TOO_HARD: 1, KEPT: 1}
    assert st["skipped"][TOO_EASY] > 0 and st["skipped"][TOO_HARD] > 0 and st["rechecks"] > 0
    tail = seen[28 * 4:]
    # draw i is task i % 4's turn; every 7th turn of a dropped task is its recheck, its other turns go to the kept
    # task 3: per 28 draws, 7 + 6 * 3 = 25 of task 3 and one of each other task
    assert [tail.count(k) for k in range(4)] == [4, 4, 4, 100]
    # the item is the base task's item, with its curation id recorded in the metadata
    item = task.item(0)
    k = item.meta["curation"]["task_id"]
    assert item.prompt == base.item(k).prompt and item.target == base.item(k).target


def test_a_dropped_task_that_the_policy_learns_comes_back():
    task = CuratedTask(get_task("repeat"), CurationConfig(band=(0.2, 0.8), pool=2, window=12, recheck_after=2))
    state = {"learnt": False, "attempts": 0}

    def reward(sample):
        if sample.item.meta["curation"]["task_id"] == 0:
            return 0.0 if task.draws % 3 else 1.0  # in the band: solved about one time in three
        state["attempts"] += 1
        return float(state["learnt"] and state["attempts"] % 3 == 0)

    _run(task, reward, 400)
    assert task.curator.verdict(1) == TOO_HARD
    state["learnt"] = True
    seen = _run(task, reward, 400, start=400)
    assert task.curator.verdict(1) == KEPT and seen[-100:].count(1) > 10  # a recheck saw it improve


def test_an_exhausted_pool_without_rechecks_raises_and_says_why():
    task = CuratedTask(get_task("repeat"), CurationConfig(pool=2, recheck_after=0))
    for k in range(2):
        task.curator.observe(k, [1.0] * 10)
    with pytest.raises(CurationExhausted, match=r"curation.band .*outside the solve-rate band.*recheck_after is 0"):
        task.item(0)
    assert CurationExhausted.fatal  # the rollout workers stop on it instead of retrying forever


def test_an_exhausted_pool_with_rechecks_rechecks_instead_of_raising():
    task = CuratedTask(get_task("repeat"), CurationConfig(pool=3, recheck_after=5))
    for k in range(3):
        task.curator.observe(k, [1.0] * 10)
    assert [task.item(i).meta["curation"]["task_id"] for i in range(6)] == [0, 1, 2, 0, 1, 2]
    assert task.stats()["rechecks"] == 6


def _filter_with_history() -> CuratedTask:
    task = CuratedTask(get_task("repeat"), CurationConfig(band=(0.2, 0.8), pool=6, window=16, recheck_after=3))
    for k, rewards in {0: [1.0] * 12, 2: [0.0] * 12, 3: [1.0, 0.0, 0.0], 5: [1.0] * 12}.items():
        task.curator.observe(k, rewards)
    return task


def test_a_draw_is_a_function_of_its_index_not_of_the_order_of_the_draws():
    indices = list(range(120))
    in_order = _filter_with_history()
    expected = {i: in_order.item(i, seed=9) for i in indices}
    assert len({t.meta["curation"]["task_id"] for t in expected.values()}) > 2
    shuffled = _filter_with_history()
    random.Random(3).shuffle(indices)
    got = {}
    threads = [threading.Thread(target=lambda part: got.update({i: shuffled.item(i, seed=9) for i in part}),
                                args=(indices[j::4],)) for j in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == expected  # same task, same prompt for each index, whatever thread drew it and when


def test_the_filter_checkpoints_and_restores_through_json():
    import json

    task = _filter_with_history()
    before = [task.item(i).meta["curation"]["task_id"] for i in range(40)]
    state = json.loads(json.dumps(task.state_dict()))
    fresh = CuratedTask(get_task("repeat"), task.config)
    assert [fresh.item(i).meta["curation"]["task_id"] for i in range(40)] != before  # a fresh filter forgets
    fresh.load_state_dict(state)
    assert fresh.stats() == task.stats()
    assert [fresh.item(i).meta["curation"]["task_id"] for i in range(40, 80)] == \
        [task.item(i).meta["curation"]["task_id"] for i in range(40, 80)]
    assert [(e.task_id, e.attempts, e.solved) for e in fresh.curator.estimates()] == \
        [(e.task_id, e.attempts, e.solved) for e in task.curator.estimates()]


@pytest.mark.parametrize("state, match", [
    ("x", "not a CuratedTask"), ({"config": {"pool": 5}}, "pool 5"),
    ({"config": {"pool": 6}, "skipped": {}, "rechecks": -1, "draws": 0, "curator": {"outcomes": []}}, "counts"),
    ({"config": {"pool": 6}, "skipped": {}, "rechecks": 0, "draws": 0, "curator": {"outcomes": [[1, [2]]]}},
     "curator state"),
    ({"config": {"pool": 6}, "skipped": {}, "rechecks": 0, "draws": 0, "curator": {"outcomes": [[[1], [True]]]}},
     "not hashable")])
def test_a_malformed_checkpoint_is_refused_and_changes_nothing(state, match):
    task = _filter_with_history()
    before = task.state_dict()
    with pytest.raises(ValueError, match=match):
        task.load_state_dict(state)
    assert task.state_dict() == before


def test_threads_draw_and_observe_concurrently():
    task = CuratedTask(get_task("repeat"), CurationConfig(band=(0.001, 0.99), pool=8, window=100))
    errors = []

    def work():
        try:
            _run(task, lambda s: 0.0, 100)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and task.draws == 400
    assert sum(e.attempts for e in task.curator.estimates()) == 400
