"""Peer replicas (``syncd.trainer.ft.replicas``, ``syncd.trainer.ft.fault_tolerance``) on real sockets and real disks:
placement never puts a checkpoint and all its replicas on one node, replicas round-trip bit for bit, a replica corrupted
at its holder or on the way is detected and skipped with the reason (the next holder's is used; nothing half-loaded), a
lost node's owner rebuilds from its peers, and the durability gate says whether every holder took a step."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from syncd.trainer.ft.checkpoint import Checkpointer, list_steps, newest_checkpoint, step_dir
from syncd.trainer.ft.ckpt_dir import write_bundle
from syncd.trainer.ft.ckpt_format import MANIFEST, StateError, manifest_digest
from syncd.trainer.ft.fault_tolerance import FaultTolerance, FTConfig, agree_step
from syncd.trainer.ft.peers import PeerDirectory, rebuild_from_peers
from syncd.trainer.ft.replica_server import ReplicaServer
from syncd.trainer.ft.replica_wire import ReplicaError
from syncd.trainer.ft.replicas import fetch_replica, place_replicas, push_replica

SECRET = "5e" * 32  # the job's replica secret (what rank 0 hands every rank)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=12), st.integers(0, 4))
def test_placement_survives_the_loss_of_any_one_node(node_ids, k):
    nodes = [f"n{i}" for i in node_ids]
    distinct = set(nodes)
    if k > len(distinct) - 1:
        with pytest.raises(ValueError, match="replicas need"):
            place_replicas(nodes, k)
        return
    holders = place_replicas(nodes, k)
    load = [0] * len(nodes)
    for i, hs in enumerate(holders):
        assert len(hs) == k and len({nodes[h] for h in hs}) == k  # k distinct nodes ...
        assert nodes[i] not in {nodes[h] for h in hs}  # ... none of them the owner's
        for h in hs:
            load[h] += 1
    for dead in distinct:  # whichever node dies, every owner's state survives somewhere (k >= 1)
        for i, hs in enumerate(holders):
            alive = [j for j in [i, *hs] if nodes[j] != dead]
            assert alive or k == 0


def _checkpoint(root, owner="rank-0", steps=2):
    torch.manual_seed(0)
    m = torch.nn.Linear(64, 32)
    opt = torch.optim.AdamW(m.parameters(), lr=0.1, foreach=False)
    ck = Checkpointer(root, owner=owner, keep=steps, on_busy="wait")
    for s in range(1, steps + 1):
        m(torch.randn(4, 64)).sum().backward()
        ck.before_update()
        opt.step()
        opt.zero_grad()
        ck.save(s, m, opt, state={"step": s})
    ck.close()
    return m, opt


def _flip(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.fixture
def servers(tmp_path):
    made = []

    def make(name):
        made.append(ReplicaServer(tmp_path / name / "held", keep=2))
        return made[-1]

    yield make
    for s in made:
        s.close()


def test_a_replica_round_trips_and_a_corrupt_one_is_skipped_for_the_next_holder(tmp_path, servers, caplog):
    own = tmp_path / "own"
    m, _ = _checkpoint(own)
    a, b = servers("a"), servers("b")
    for srv in (a, b):
        for s in list_steps(own):
            push_replica(srv.url, step_dir(own, s), owner="rank-0", step=s)
    assert list_steps(a.root / "rank-0") == [2, 1] and a.received == 2
    d = PeerDirectory(f"file://{tmp_path / 'store'}", "run")
    d.announce("a", a.url, "n1")
    d.announce("b", b.url, "n2")
    d.record("rank-0", {s: manifest_digest((step_dir(own, s) / MANIFEST).read_bytes()) for s in list_steps(own)})
    _flip(step_dir(a.root / "rank-0", 2) / "model.safetensors")  # bit rot at the first holder
    with caplog.at_level(logging.WARNING, "syncd.trainer.ft.replicas"):
        bundle, c, holder = rebuild_from_peers("rank-0", ["a", "b"], d)
    assert (c.step, holder, c.source) == (2, "b", "b")  # a's step 2 skipped, b's step 2 taken
    assert "replica of step 2 held by a skipped" in caplog.text
    assert "model.safetensors does not match its SHA-256 in the manifest (corrupt)" in caplog.text
    assert all(torch.equal(c.model[k], v) for k, v in m.state_dict().items())
    lost = tmp_path / "rebuilt"
    write_bundle(bundle, lost)  # persisted as it arrived: a checkpoint that verifies on its own
    assert newest_checkpoint(lost, owner="rank-0").step == 2
    assert not [p for p in lost.iterdir() if p.name.startswith(".tmp")]  # nothing half-written left


def test_a_replica_corrupted_on_the_way_is_refused_by_the_holder(tmp_path, servers):
    own = tmp_path / "own"
    _checkpoint(own, steps=1)
    bad = tmp_path / "bad"
    shutil.copytree(step_dir(own, 1), bad)
    _flip(bad / "optim.safetensors")  # the manifest says one thing, the bytes another
    a = servers("a")
    with pytest.raises(ReplicaError, match=r"refused the replica of rank-0 step 1: HTTP 400 .*optim.safetensors "
                                           r"does not match its SHA-256"):
        push_replica(a.url, bad, owner="rank-0", step=1)
    assert list_steps(a.root / "rank-0") == [] and a.refused == 1
    push_replica(a.url, step_dir(own, 1), owner="rank-0", step=1)  # the holder is fine afterwards
    with pytest.raises(StateError, match="the state of 'rank-0', expected 'rank-7'"):
        # a holder that answers with another owner's state: refused on arrival, nothing lands
        _swap_owner(a, tmp_path)
    assert not (tmp_path / "dest7").exists() or list_steps(tmp_path / "dest7") == []


def _swap_owner(server, tmp_path):
    shutil.copytree(step_dir(server.root / "rank-0", 1), step_dir(server.root / "rank-7", 1))
    fetch_replica(server.url, "rank-7", 1, tmp_path / "dest7")


def test_a_lost_node_rebuilds_from_its_peers_and_the_gate_counts_holders(tmp_path, caplog):
    store = f"file://{tmp_path / 'store'}"
    owners, nodes = ("rank-0", "rank-1", "rank-2"), ("n0", "n1", "n2")
    fts = [FaultTolerance(FTConfig(str(tmp_path / n), o, owners, nodes, store, "run", replicas=2, keep=2,
                                   on_busy="wait", gate_timeout_s=30, secret=SECRET)) for o, n in zip(owners, nodes)]
    try:
        models = []
        for ft in fts:
            torch.manual_seed(len(models))
            m = torch.nn.Linear(32, 8)
            opt = torch.optim.AdamW(m.parameters(), lr=0.1, foreach=False)
            m(torch.randn(2, 32)).sum().backward()
            opt.step()
            ft.checkpointer.save(1, m, opt, state={"step": 1}, wait=True)
            models.append(m)
        assert all(ft.durable(1) for ft in fts)  # on disk and on both holders
        assert agree_step([ft.available() for ft in fts]) == 1
        fts[1].close()
        shutil.rmtree(tmp_path / "n1")  # node n1 is gone, disk and all; its owner comes back elsewhere
        fts[1] = FaultTolerance(FTConfig(str(tmp_path / "n1-new"), "rank-1", owners, nodes, store, "run",
                                         replicas=2, keep=2, on_busy="wait", gate_timeout_s=30, secret=SECRET))
        assert fts[1].available() == [1]  # only its peers have it
        c = fts[1].restore(step=1)
        assert c is not None and c.step == 1 and c.source in ("rank-0", "rank-2")
        assert all(torch.equal(c.model[k], v) for k, v in models[1].state_dict().items())
        fts[1]._persisting.join()  # written to the new disk in the background, then counted durable
        assert newest_checkpoint(tmp_path / "n1-new" / "rank-1" / "own", owner="rank-1").step == 1
        assert fts[1].checkpointer.durable_step == 1
        fts[2].close()  # a holder dies: the next step is on fewer holders than asked, and the gate says so
        fts[0].checkpointer.save(2, models[0], None, state={"step": 2}, wait=True)
        with caplog.at_level(logging.WARNING, "syncd.trainer.ft.fault_tolerance"):
            assert fts[0].durable(2, timeout=30) is False
        assert "step 2 is replicated on 1 of 2 holders (rank-2)" in caplog.text
    finally:
        for ft in fts:
            try:
                ft.close()
            except Exception:  # noqa: BLE001 -- closed above
                pass


def test_the_live_heal_state_is_verified_before_it_is_parsed(tmp_path):
    import io

    from syncd.trainer.ft.heal import decode_state, encode_state

    state = {"model": {"w": torch.arange(6.0)}, "step": 3, "lr": 0.5}
    frame = encode_state("group-1", 3, state)
    got = decode_state(io.BytesIO(frame).read, len(frame), where="heal", step=3)
    assert torch.equal(got["model"]["w"], state["model"]["w"]) and got["step"] == 3 and got["lr"] == 0.5
    bad = bytearray(frame)
    bad[-3] ^= 0x10  # one bit of a tensor on the wire
    with pytest.raises(StateError, match="tensors.safetensors does not match its SHA-256"):
        decode_state(io.BytesIO(bytes(bad)).read, len(bad), where="heal", step=3)
    with pytest.raises(StateError, match="the state of step 3, expected step 4"):  # a stale answer
        decode_state(io.BytesIO(frame).read, len(frame), where="heal", step=4)
    with pytest.raises(StateError, match="ended .* bytes early"):  # a peer that died mid-transfer
        decode_state(io.BytesIO(frame[:-10]).read, None, where="heal", step=3)


def test_restoring_an_older_step_drops_the_later_ones_and_their_durability(tmp_path):
    ft = FaultTolerance(FTConfig(str(tmp_path / "n0"), "rank-0", ("rank-0",), ("n0",), f"file://{tmp_path / 's'}",
                                 "run", replicas=0, keep=3, on_busy="wait", secret=SECRET))
    try:
        m = torch.nn.Linear(4, 2)
        for s in (1, 2):
            ft.checkpointer.save(s, m, None, state={"step": s}, wait=True)
        assert ft.durable(2, timeout=5)
        c = ft.restore(step=1)  # the job agreed on step 1 (another rank lacks step 2)
        assert c.step == 1 and list_steps(ft.own) == [1] and ft.checkpointer.durable_step == 1
        assert ft.durable(2, timeout=0.3) is False  # step 2's lineage is gone: it must not gate a publish open
    finally:
        ft.close()
