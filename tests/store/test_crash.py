"""A publisher process killed with SIGKILL at random points of its upload: no reader ever sees a partial
version, and the next publisher carries on. The first three kills land on a shard write, the manifest write and the
hint write (in a random order, each at a random occurrence, before or after the write), and each is checked: the
child says where it died, and the store shows exactly what that point implies (a version whose manifest was not
written is not there; one whose manifest was is there whole, and the newest version is found even when the hint
was not updated)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import syncd
from syncd.errors import VersionNotFound
from syncd.store import Store
from syncd.versions import list_versions, read_manifest, verify_run

from ._models import assert_same, trajectory
from .conftest import KEY

RUN = "crashy"
ROOT = Path(__file__).resolve().parents[2]
SEED = int(os.environ.get("SYNCD_TEST_SEED", "20261130"))


def child(store: Path, states: Path, start: int, count: int, kill_at: int = 0, after: bool = False,
          step_s: float = 0.0, kind: str | None = None):
    cmd = [sys.executable, "-m", "tests.store._publisher_child", str(store), RUN, str(states), str(start),
           str(count), "--step-s", str(step_s)]
    if kill_at:
        cmd += ["--kill-at", str(kill_at)] + (["--kill-after"] if after else [])
        cmd += ["--kill-kind", kind] if kind else []
    env = dict(os.environ, SYNCD_SIGNING_KEY=KEY,
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _version_in(key: str) -> int | None:
    """The version whose directory ``key`` is in (None for the run's hint)."""
    parts = key.split("/")
    return int(parts[parts.index("versions") + 1]) if "versions" in parts else None


def check_store(store: Store, states) -> int | None:
    """Every committed version materializes to exactly the weights of its step; returns the newest step."""
    newest = None
    for info in list_versions(store, RUN, signing_key=KEY):
        assert info.error is None, info.error
        if info.manifest is None:
            continue  # torn: shards of a killed upload, never visible as a version
        m = info.manifest
        assert_same(syncd.materialize(store, RUN, m.version, signing_key=KEY), states[m.step])
        newest = m.step
    return newest


@pytest.mark.integration
@pytest.mark.slow
def test_sigkill_during_upload_never_exposes_a_partial_version(tmp_path):
    rng = random.Random(SEED)
    states = trajectory(24)
    states_file = tmp_path / "states.pt"
    torch.save(list(states), states_file)
    root = tmp_path / "store"
    store = Store(root)
    next_step, kills, first_versions = 0, [], []

    # rounds 1-3: the child kills itself at a shard write, at the manifest write and at the hint write
    kinds = ["shard", "manifest", "hint"]
    rng.shuffle(kinds)
    for kind in kinds:
        kill_at, after = rng.randint(1, 6 if kind == "shard" else 3), rng.random() < 0.5
        before = syncd.latest_version(store, RUN, signing_key=KEY)
        p = child(root, states_file, next_step, 10, kill_at, after, kind=kind)
        _, err = p.communicate(timeout=120)
        assert p.returncode == -signal.SIGKILL, err.decode()[-2000:]
        said = [ln.split() for ln in err.decode().splitlines() if ln.startswith("KILL ")]
        assert said and said[-1][:4] == ["KILL", kind, str(kill_at), "after" if after else "before"], said
        kills.append((kind, kill_at, after, said[-1][4]))
        newest = check_store(store, states)
        listed = {i.version for i in list_versions(store, RUN, signing_key=KEY) if i.manifest is not None}
        killed_version = _version_in(said[-1][4])
        if kind == "shard" or (kind == "manifest" and not after):
            assert killed_version not in listed, (kills[-1], listed)  # never visible without its manifest
        else:  # the manifest was written: the version is there, whole, and found even under a stale hint
            killed_version = killed_version if kind == "manifest" else max(listed)
            assert killed_version in listed, (kills[-1], listed)
            assert syncd.latest_version(store, RUN, signing_key=KEY) == killed_version == max(listed)
        first_versions.append(None if before is None else before + 1)
        next_step = 0 if newest is None else newest + 1
    assert sorted(k[0] for k in kills) == ["hint", "manifest", "shard"], kills

    # round 5: killed from outside at a random moment while a reader polls the run
    seen, problems, stop = [], [], threading.Event()

    def reader():
        while not stop.is_set():
            v = syncd.latest_version(store, RUN, signing_key=KEY)
            if v is None:
                continue
            m = read_manifest(store, RUN, v, signing_key=KEY)
            try:
                assert_same(syncd.materialize(store, RUN, v, signing_key=KEY), states[m.step])
                seen.append(v)
            except VersionNotFound:
                pass
            except Exception as exc:  # noqa: BLE001
                problems.append(repr(exc))

    start_version = syncd.latest_version(store, RUN, signing_key=KEY)
    t = threading.Thread(target=reader)
    t.start()
    p = child(root, states_file, next_step, 100, step_s=0.05)  # ~50 ms training steps
    deadline = time.monotonic() + 60
    while syncd.latest_version(store, RUN, signing_key=KEY) == start_version and time.monotonic() < deadline:
        time.sleep(0.01)  # poll until the child has committed its first version
    time.sleep(rng.uniform(0.0, 0.25))  # the random kill point
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    stop.set()
    t.join()
    assert p.returncode == -signal.SIGKILL, "the publisher finished before it could be killed"
    assert problems == [] and seen, problems
    newest = check_store(store, states)
    next_step = newest + 1

    # the next publisher carries on from the newest committed version and finishes the run
    p = child(root, states_file, next_step, 100)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 0, err.decode()[-2000:]
    assert check_store(store, states) == len(states) - 1
    report = list(verify_run(store, RUN, signing_key=KEY))
    assert [r for r in report if r[1] == "failed"] == []
    # a new publisher always starts with a full version right after the newest committed one
    infos = {i.version: i.manifest for i in list_versions(store, RUN, signing_key=KEY) if i.manifest}
    for v in first_versions:
        if v is not None and v in infos:
            assert infos[v].kind == "full"
    assert len({m.session for m in infos.values()}) >= 2, "more than one publisher wrote the run"
