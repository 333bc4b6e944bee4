"""``LoopConfig.curation`` puts the difficulty filter on the loop's task sampler: the live side starts its rollout
workers on a :class:`syncd.trainer.rl.curation.CuratedTask` (the proxy here is ``tests.trainer._fake_proxy``; its
records never reach the store, so no group reaches the buffer or is trained -- the sampler is what is checked, and that
the curator saw none of those dropped groups' rewards)."""

from __future__ import annotations

import time

from syncd.engine.reference.make_tiny import write_model
from tests.trainer._fake_proxy import FakeProxy
from syncd.trainer.rl.curation import CuratedTask, CurationConfig
from syncd.trainer.rl.live import LiveSide
from syncd.trainer.rl.config import LoopConfig


def test_the_loops_task_sampler_is_curated(tmp_path):
    from transformers import AutoModelForCausalLM

    model_dir = write_model(tmp_path / "tiny", hidden=16, layers=1, heads=2, kv_heads=1, intermediate=32)
    (tmp_path / "store").mkdir()
    proxy = FakeProxy()  # answers "aaaaaaaa" to every prompt
    cfg = LoopConfig(model=str(model_dir), store=(tmp_path / "store").as_uri(), run_id="rl", out=str(tmp_path / "out"),
                     proxies=(proxy.url,), group_size=2, groups_per_step=1, record_timeout_s=0.1, plot=False,
                     curation=CurationConfig(band=(0.2, 0.8), pool=4, window=8))
    cfg.check()
    live = LiveSide(cfg, AutoModelForCausalLM.from_pretrained(model_dir))
    try:
        live.start()
        assert isinstance(live.workers.task, CuratedTask) and live.workers.task is live.curated
        deadline = time.monotonic() + 60
        while live.workers.failures.totals.get("replay", 0) < 2:
            assert time.monotonic() < deadline, live.workers.stats()
            time.sleep(0.05)
        st = live.curated.stats()
        assert st["pool"] == 4 and st["draws"] >= 2
        assert not live.curated.curator.estimates()  # the groups were dropped before the buffer: nothing observed
        seen = {k for t, b in proxy.requests for k in range(4) if b["prompt"] == live.curated.task.item(k).prompt}
        assert seen  # the prompts came from the curated pool
        live.curated.observe(live.curated.item(0, 0), [1.0, 1.0])
        snap = live.snapshot()  # the RL state checkpoint carries the filter's state (restored by LiveSide._restore)
        assert snap["curation"] == live.curated.state_dict() and snap["curation"]["curator"]
    finally:
        live.abort()
        proxy.close()
