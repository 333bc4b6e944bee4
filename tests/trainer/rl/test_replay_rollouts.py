"""Trainer-side replay end to end on real parts: reference-engine workers under the Dynamo frontend (dense Qwen2 on
a file store, Qwen3-MoE on the moto S3 server on loopback) generate at temperature 1, top-p 0.8, top-k 20
through the sandbox proxy, while ``WeightPublisher`` publishes a version from a real AdamW step that the workers
apply mid-trajectory (``bench.rollouts``). The trainer reads the rollouts back from the store and recomputes
every token's log-prob on the same weight versions: with kept-set and routing replay it reproduces the engine;
without, the gap shows. The workers record kept sets to rebuild (tolerance 1e-3): the trainer rebuilds them from the
logits it recomputes, and from the newest weights only the sets those still rank alike verify."""

from __future__ import annotations

import urllib.request
import uuid

import pytest
import torch

from bench.rollouts import RolloutConfig, generate
from syncd.ops.replay import kept_rows
from tests.store.conftest import s3_endpoint  # noqa: F401 -- the loopback S3 server
from syncd.trainer.rl import correction as C
from syncd.trainer.rl.batch import collate
from syncd.trainer.rl.logprobs import resolve_kept, sampler_logprobs, trainer_logprobs
from syncd.trainer.rl.replay import routing_replay
from syncd.trainer.rl.rollouts import read_rollouts

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# The streams start on the same engine step and the update is applied once every stream has made 16 tokens; the
# engines are paused in steps up to there (bench.rollouts), so they hold the streams near 16 tokens even where the
# clients see the tokens late and in bursts (a busy machine). The other 80 are the margin for a step that runs long.
CFG = dict(requests=3, max_tokens=96, concurrency=3, updates=1, update_every=16, pretrain_steps=30, hidden=32,
           kept_tolerance=1e-3)
N = CFG["max_tokens"]


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    root = tmp_path_factory.mktemp("replay-dense")
    store_url = (root / "store").resolve().as_uri()
    return generate(root, store_url, RolloutConfig(arch="qwen2", **CFG))


@pytest.fixture(scope="module")
def moe(tmp_path_factory, s3_endpoint):  # noqa: F811
    root = tmp_path_factory.mktemp("replay-moe")
    with pytest.MonkeyPatch.context() as mp:
        for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1",
                     "AWS_ENDPOINT_URL": s3_endpoint}.items():
            mp.setenv(k, v)
        bucket = f"b-{uuid.uuid4().hex[:12]}"
        urllib.request.urlopen(urllib.request.Request(f"{s3_endpoint}/{bucket}", method="PUT"), timeout=10).read()
        run = generate(root, f"s3://{bucket}/rl", RolloutConfig(arch="qwen3_moe", **CFG))
        run.rollouts = read_rollouts(run.store_url, run.run_id, num_experts=8, vocab_size=320)  # while env is set
        yield run


@pytest.fixture(scope="module")
def runs(dense, moe):
    dense.rollouts = read_rollouts(dense.store_url, dense.run_id, vocab_size=320)
    for run in (dense, moe):  # every kept set, rebuilt from the logits of the versions that sampled it
        run.resolved = resolve_kept(run.trainer_model(), run.rollouts.sequences, weights_of=run.weights_of)
    return {"dense": dense, "moe": moe}


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_rollouts_join_both_records_and_carry_the_update_mid_trajectory(runs, kind):
    run = runs[kind]
    rs = run.rollouts
    assert not rs.dropped and rs.skipped_failed == 0 and len(rs.rollouts) == 3
    assert sorted((r.sandbox_id, r.trajectory_id) for r in rs.rollouts) == sorted(run.trajectories)
    pending = sum(len(s.kept_pending) for s in rs.sequences if s.kept_pending is not None)
    assert pending > 0.3 * 3 * N  # the workers recorded most sets to be rebuilt
    for seq in run.resolved:
        gen = seq.versions[seq.loss_mask].tolist()
        assert len(gen) == N and gen[0] == 0 and gen[-1] == 1 and gen == sorted(gen), (run.applied_at, gen)  # 0 -> 1
        assert seq.positions.numel() == N and seq.temperature == 1.0
        sizes = seq.kept_offsets[1:] - seq.kept_offsets[:-1]
        assert int(sizes.max()) <= 20  # top-k 20
        rows = kept_rows(seq.kept_offsets)
        assert bool((seq.kept_ids.long() == seq.tokens[seq.positions][rows]).long().sum() == N)
        if kind == "moe":
            assert seq.routes.shape == (len(seq), 2, 2) and seq.routes.dtype == torch.int8
            assert int(seq.routes.max()) < 8 and (seq.routes[:-1] >= 0).all() and (seq.routes[-1] == -1).all()
        else:
            assert seq.routes is None


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_full_replay_on_the_same_versions_reproduces_the_engine(runs, kind):
    run = runs[kind]
    model = run.trainer_model()
    engine, full, kept_only, replayed = [], [], [], []
    for seq in run.rollouts.sequences:
        engine.append(seq.logprobs[seq.positions])
        full.append(sampler_logprobs(model, seq, weights_of=run.weights_of, kept=False, routing=False).logprobs)
        kept_only.append(sampler_logprobs(model, seq, weights_of=run.weights_of, routing=False).logprobs)
        r = sampler_logprobs(model, seq, weights_of=run.weights_of)
        assert r.kept.rebuilt == len(seq.kept_pending) and r.kept.mismatches == 0  # rebuilt, every one verified
        replayed.append(r.logprobs)
        if kind == "moe":
            assert r.disagreement == 0.0
    engine, full, kept_only, replayed = map(torch.cat, (engine, full, kept_only, replayed))
    exact = C.ratio_stats(replayed, engine)
    assert abs(exact.mean - 1) < 1e-4 and exact.max_abs_log_ratio <= 1e-4 and exact.outside == 0
    assert C.ratio_stats(kept_only, engine).max_abs_log_ratio <= 1e-4  # fp32 routers agree with the engine's
    gap = C.ratio_stats(full, engine)  # top-p/top-k renormalisation not replayed
    assert gap.mean < 0.95 and gap.outside > 0.3 and gap.kl_k3 > 1e-3
    split = C.mismatch_by_source(engine, replayed, own_routing=kept_only, full_vocab=full)
    assert split.components["kept_set"]["mean"] < -0.05 and split.components["numerics"]["max_abs"] <= 1e-4


def test_each_token_uses_its_own_versions_log_prob(runs):
    run = runs["dense"]
    model = run.trainer_model()
    seq = run.resolved[0]
    pos, engine = seq.positions, seq.logprobs[seq.positions]
    tv = seq.versions[pos]
    by_version = {}
    for v in (0, 1):  # a plain full-sequence recomputation on each version's weights
        seq_v = type(seq)(**{**seq.__dict__, "row_versions": torch.zeros_like(seq.row_versions)})
        model.load_state_dict(run.weights_of(v))
        by_version[v] = sampler_logprobs(model, seq_v).logprobs
    chosen = C.select_by_version(by_version, tv)
    old = tv == 0
    assert (chosen - engine)[old].abs().max() <= 1e-4  # before the update: that version's weights reproduce it
    assert (by_version[1] - engine)[old].abs().max() > 1e-3  # ... and the newer weights do not
    # after the update the engine kept the old weights' keys and values of the earlier positions: only the
    # segmented recomputation (each position on the version it ran with, one KV cache) reproduces that exactly
    segmented = sampler_logprobs(model, seq, weights_of=run.weights_of).logprobs
    assert (segmented - engine).abs().max() <= 1e-4
    assert (chosen - engine)[~old].abs().max() > (segmented - engine)[~old].abs().max()
    lag = C.staleness(tv, 1)
    assert lag["counts"][1] == int(old.sum()) and lag["counts"][0] == int((~old).sum())


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_training_gradient_with_replay_matches_the_naive_masked_softmax(runs, kind):
    run = runs[kind]
    batch = collate(run.resolved)  # the trainer is a version ahead of the first tokens: sets resolved first
    w = torch.linspace(-1, 1, batch.targets.numel())
    model = run.trainer_model()
    out = trainer_logprobs(model, batch)
    (out.logprobs * w).sum().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    if kind == "moe":
        # the newest weights' own routers against the recorded routes: they differ where older versions ran, a share
        # that depends on how many tokens each stream made before the update landed (the machine's speed)
        assert out.disagreement is not None and out.disagreement < 0.2
        assert got["model.layers.0.mlp.gate.weight"].abs().sum() > 0  # the router is trained under replay
    model.zero_grad()
    B, T = batch.shape
    with routing_replay(model, batch.routes) if batch.routes is not None else torch.enable_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.reshape(B * T, -1)
        rows = logits[batch.rows]
        mask = torch.full_like(rows, float("-inf"))
        mask[kept_rows(batch.kept_offsets), batch.kept_ids] = 0.0
        naive = torch.log_softmax(rows + mask, -1).gather(1, batch.targets[:, None])[:, 0]
        (naive * w).sum().backward()
    torch.testing.assert_close(out.logprobs.detach(), naive.detach(), atol=2e-6, rtol=0)
    for n, p in model.named_parameters():
        # two float32 orders of the same sums over the batch: their difference scales with the tensor's largest
        # entry (the batch, and so that scale, depends on how fast the engines ran)
        scale = float(p.grad.abs().max())
        torch.testing.assert_close(got[n], p.grad, atol=1e-6 + 1e-5 * scale, rtol=1e-4)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_a_trainer_a_version_ahead_rebuilds_only_what_it_still_ranks_alike(runs, kind):
    """The newest weights' own logits: the sets they rank alike verify (and are the engine's), the others are
    refused by name or, with on_mismatch="drop", counted, never replaced by other sets."""
    from syncd.trainer.rl.kept import KeptRebuildError

    run = runs[kind]
    pending, resolved = collate(run.rollouts.sequences), collate(run.resolved)
    model = run.trainer_model()  # the newest version: the first 16 tokens of each stream were sampled before it
    r = trainer_logprobs(model, pending, on_mismatch="drop")
    assert r.kept.rebuilt + r.kept.mismatches == len(pending.kept_pending) and r.kept.rebuilt > 0
    for g in r.kept.valid.nonzero()[:, 0].tolist():
        assert torch.equal(r.kept.ids[r.kept.offsets[g]:r.kept.offsets[g + 1]],
                           resolved.kept_ids[resolved.kept_offsets[g]:resolved.kept_offsets[g + 1]])
    if r.kept.mismatches:
        with pytest.raises(KeptRebuildError, match="do not match these logits"):
            trainer_logprobs(model, pending)
