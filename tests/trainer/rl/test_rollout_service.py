"""The rollout service on real parts: ``syncd rollouts`` as its own process, sending prompts through a sandbox proxy
process to a reference-engine worker under the Dynamo frontend, writing groups to the run's queue in a file store,
and this test as the trainer (reading the queue, moving its position, sending a group back).

Killed with SIGKILL while groups are in flight and started again: no attempt is sent twice (every trajectory record
of one attempt comes from one life of the service), none is lost (every prompt claimed before the kill lands, the
orphaned ones as their next attempt), each prompt lands once; the backlog never passes ``--max-backlog`` while the
trainer does not read; a group the trainer sends back is generated again; every group read rebuilds from its
records as the trainer rebuilds it."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import pytest

from syncd.procs import stop_process, wait_until
from syncd.trainer.rl.group_queue import GroupQueue

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RUN = "svc"
BACKLOG = 6


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """``(proxy URL, model name, store URL, root)``: one recording worker, the frontend, a proxy process."""
    from syncd.engine.reference.make_tiny import write_model
    from tests.dynamo._recording import recording_node

    root = tmp_path_factory.mktemp("rollout-service")
    model = write_model(root / "tiny", arch="qwen2", seed=3)
    with recording_node(root, model, RUN, "rs", sandbox="sb-svc") as (_, cfg, store, url):
        yield url, cfg.model_name, store, root


def _service(stack, log_name: str) -> subprocess.Popen:
    url, _, store, root = stack
    log = open(root / log_name, "ab")
    return subprocess.Popen([sys.executable, "-m", "syncd.trainer.rl.rollout_service", "--store", store,
                             "--run-id", RUN, "--proxy", url, "--service-id", "svc", "--task", "repeat",
                             "--task-length", "24", "--group-size", "2", "--workers", "2", "--max-backlog", str(BACKLOG),
                             "--poll-interval-s", "0.2", "--vocab-size", "320"],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)


def _claims_in_flight(q: GroupQueue) -> set:
    st = q.state("svc")
    return set(st.claims) - set(st.landed) - set(st.failed)


def test_killed_mid_dispatch_no_attempt_is_sent_twice_none_is_lost_and_the_backlog_holds(stack):
    from syncd.trainer.rl.group_reader import GroupReader

    store = stack[2]
    q = GroupQueue(store, RUN)
    svc = _service(stack, "service-1.log")
    try:
        # the first life: kill -9 it once two groups landed and at least one more is in flight
        wait_until(lambda: len(q.state("svc").landed) >= 2 and _claims_in_flight(q), 240,
                   "two groups in the queue and one in flight", interval_s=0.05,
                   alive=lambda: svc.poll() is not None and f"exited {svc.returncode}")
        svc.send_signal(signal.SIGKILL)
        svc.wait(30)
        at_kill = q.state("svc")
        orphans = set(at_kill.claims) - set(at_kill.landed) - set(at_kill.failed)
        assert orphans, "the kill landed when nothing was in flight"
        claimed_before = {i for i, _ in at_kill.claims}

        # no trainer reads: the second life fills the backlog and pauses there
        svc = _service(stack, "service-2.log")
        wait_until(lambda: len(q.state("svc").landed) >= BACKLOG, 240, "the backlog to fill", interval_s=0.2,
                   alive=lambda: svc.poll() is not None and f"exited {svc.returncode}")
        time.sleep(3)  # dispatch paused: nothing past the backlog (in flight at the fill counts against it)
        assert len(q.state("svc").landed) == BACKLOG

        # the trainer reads; one group it sends back; the service goes on
        docs, pos = q.read_groups("svc", 0)
        assert len(docs) == BACKLOG
        q.set_consumer({"svc": pos}, step=1)
        returned = docs[0]
        assert q.fail(returned["item"]["index"], returned["attempt"], "dropped: stale", by="trainer")
        want = claimed_before | {returned["item"]["index"]}

        def landed_all() -> bool:
            nonlocal pos
            more, pos = q.read_groups("svc", pos)
            docs.extend(more)
            q.set_consumer({"svc": pos}, step=2)
            got = {(d["item"]["index"], d["attempt"]) for d in docs}
            return want <= {i for i, _ in got} and any(
                i == returned["item"]["index"] and a > returned["attempt"] for i, a in got)

        wait_until(landed_all, 240, "every prompt claimed before the kill, and the returned one, to land",
                   interval_s=0.2, alive=lambda: svc.poll() is not None and f"exited {svc.returncode}")
        assert stop_process(svc, 30) == 0
    finally:
        stop_process(svc, 5, signal.SIGKILL)

    st = q.state("svc")
    # none lost: every orphan of the kill was failed and landed as a later attempt
    for i, a in orphans:
        assert (i, a) in st.failed and any(j == i and b > a for j, b in st.landed)
    # each prompt landed once, but for the one the trainer sent back
    landed = [i for i, _ in st.landed]
    assert sorted(set(landed)) == sorted(landed) or \
        [i for i in set(landed) if landed.count(i) > 1] == [returned["item"]["index"]]
    # no attempt sent twice: the records of one attempt come from one life of the service
    lives: dict = {}
    for info in q.store.list(f"runs/{RUN}/trajectories/"):
        m = re.search(r"/([0-9a-f]{6})-g(\d{6})(?:r(\d+))?-s\d{2}\.json$", info.key)
        if m:
            lives.setdefault((int(m.group(2)), int(m.group(3) or 0)), set()).add(m.group(1))
    assert lives and all(len(v) == 1 for v in lives.values()), {k: v for k, v in lives.items() if len(v) > 1}
    assert len({life for v in lives.values() for life in v}) == 2  # both lives sent requests
    # the trainer rebuilds every group it read from the records (per-token versions checked)
    reader = GroupReader(store, RUN, vocab_size=320)
    for d in docs:
        g = reader.reread(d)
        assert g.item.index == d["item"]["index"] and g.tokens == 2 * 24
