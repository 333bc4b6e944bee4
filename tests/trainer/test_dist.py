"""The trainer's process groups release their native threads at ``close()``, not at interpreter exit:
``syncd.trainer.dist.DataParallel`` on a real two-rank gloo group (two processes on loopback) and
``syncd.trainer.ft.elastic.ElasticDP`` on torchft with a real lighthouse."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# The names of this process's native threads; one that ends while they are listed is left out.
_THREAD_NAMES = """
def thread_names():
    names = []
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as fh:
                names.append(fh.read().strip())
        except FileNotFoundError:
            pass
    return sorted(names)
"""

# One rank: join, make the run deterministic (the order ``syncd.trainer.rl.loop`` uses), a step's collectives, close;
# then the names of this process's native threads.
_RANK = """
import json, os
""" + _THREAD_NAMES + """
from syncd.trainer.dist import DataParallel, make_deterministic
dp = DataParallel()
make_deterministic(0)
total = dp.all_reduce_sum([float(dp.rank + 1)])
box = dp.broadcast({"step": 1} if dp.is_main else None)
gathered = dp.gather(dp.rank)
dp.close()
names = thread_names()
print(json.dumps({"total": total, "box": box, "gathered": gathered, "threads": names}))
"""

# One replica group of an elastic job: a lighthouse, a quorum of one, an all-reduce, a commit, close.
_GROUP = """
import json, os
""" + _THREAD_NAMES + """
from syncd.trainer.ft.elastic import ElasticDP, start_lighthouse
lh, url = start_lighthouse(1, timeout_s=120)
try:
    dp = ElasticDP(group=0, groups=1, lighthouse=url, min_replicas=1, state_dict=dict,
                   load_state_dict=lambda sd: None, transport=None, timeout_s=60)
    dp.begin_step()
    total = dp.all_reduce_sum([2.0])
    committed = dp.commit()
    dp.close()
finally:
    lh.kill()
    lh.wait()
names = thread_names()
print(json.dumps({"total": total, "committed": committed, "threads": names}))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_close_frees_the_process_group_before_interpreter_exit():
    """After ``close()`` no gloo thread is left: a group still alive at interpreter exit can abort the rank
    (seen in CI: ``terminate called without an active exception``, exit status -6, on a run that had finished).
    Importing ``torch._inductor`` after ``init_process_group`` (``make_deterministic`` does) used to keep the
    group alive."""
    port = str(_free_port())
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
           "PYTHONPATH": str(ROOT)}
    ranks = [subprocess.Popen([sys.executable, "-c", _RANK], env={**env, "RANK": str(r)}, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=300) for p in ranks]
    for p, (out, err) in zip(ranks, outs):
        assert p.returncode == 0, err[-3000:]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert [r["total"] for r in results] == [[3.0], [3.0]]
    assert [r["box"] for r in results] == [{"step": 1}, {"step": 1}]
    assert results[0]["gathered"] == [0, 1] and results[1]["gathered"] is None
    for r in results:
        assert not [t for t in r["threads"] if "gloo" in t], r["threads"]


def test_elastic_close_frees_the_gloo_group():
    """``ElasticDP.close`` drops torchft's gloo group (its threads joined then, not at exit). The parent's
    ``RUST_LOG=warn`` (what ``syncd.trainer.run`` sets below info) must not hide the lighthouse's port line, on which
    ``start_lighthouse`` used to wait forever."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RUST_LOG": "warn"}
    p = subprocess.run([sys.executable, "-c", _GROUP], env=env, cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["total"] == [2.0] and r["committed"] is True
    assert not [t for t in r["threads"] if "gloo" in t], r["threads"]
