"""``python -m bench.projection --validate``: the projection model (:mod:`bench._projection_model`) against real runs.

For each model size a :class:`bench.netsim.cluster.SimCluster` runs the real path -- ``WeightPublisher`` in a trainer
namespace, the writable S3 endpoint in a store namespace, node daemons in cluster mode (controller, tree
broadcast) each keeping a headless engine process current, one node per namespace -- on ``tc``-shaped links whose
rates scale with the size (so that every stage takes seconds at every size): the long link (the store's egress),
the trainer's upload and each node's link. A full version is distributed unshaped first (the engines are rebuilt
from it); then the links are shaped and deltas of each density are published, ``repeats`` times, one at a time.

Each stage is timed from the processes' own records (:meth:`SimCluster.timeline`): the publisher's ``VersionStats``
and the wall time its manifest write returned; each node's cluster events (``plan``, ``store_read``, ``delivered``);
each daemon's update record (``stage_s``, ``pause_s``, ``done_at``): see :func:`measured_stages`. The model is fed the
same configuration -- the shaped rates, the cluster's settings, the publisher's shard size and tensors, the
manifest's size, this machine's cores shared by the simulated nodes -- and one-core rates measured in the same run
on a sample of the same synthetic weights (:func:`measure_rates`). Each row: ``params``, ``density``, ``nodes``,
``stage`` (a stage or ``total``), ``measured_s`` (median over the repeats), ``predicted_s`` and their ratio.
"""

from __future__ import annotations

import hashlib
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from bench._projection_model import STAGES, Rates, Setup, link_Bps, stages
from bench.netsim.nodes import SCRUB_BYTES

__all__ = ["cpu_probe", "measure_costs", "rates_now", "measured_stages", "validate", "cluster_setup", "accuracy", "run"]


_PROBE_DATA = os.urandom(2 << 20)


def _probe_job(_=None, rounds: int = 24) -> float:
    """Seconds of the probe: ``rounds`` SHA-256 passes over 2 MiB (compute-bound, the GIL released)."""
    t = time.perf_counter()
    for _ in range(rounds):
        hashlib.sha256(_PROBE_DATA).digest()
    return time.perf_counter() - t


def cpu_probe(ks=(2,)) -> dict:
    """What this machine's CPUs give now: ``t1``, the seconds of the probe job (:func:`_probe_job`) run alone, and
    for each ``k`` of ``ks`` the cores that ``k`` probe jobs at once get together (``k * t1 / their mean seconds``:
    2 for ``k >= 2`` on an idle 2-core machine, less when other work shares it)."""
    t1 = _probe_job()
    cores = {}
    for k in ks:
        with ThreadPoolExecutor(k) as ex:
            cores[str(k)] = min(float(os.cpu_count() or 1), k * t1 / statistics.mean(ex.map(_probe_job, range(k))))
    return {"t1": t1, "cores": cores}


def _units(fn, repeats: int, setup=None, *, native_threads: str = "1") -> float:
    """The seconds of ``fn`` on one thread (the native codec's ``native_threads``; "": as many as it takes, as an
    engine process runs it; torch on one) in probe units: the median over ``repeats`` runs of its time over the
    probe job's, run just before it (a busy machine slows both alike)."""
    before, threads = os.environ.get("SYNCD_NUM_THREADS"), torch.get_num_threads()
    if native_threads:
        os.environ["SYNCD_NUM_THREADS"] = native_threads
    else:
        os.environ.pop("SYNCD_NUM_THREADS", None)
    torch.set_num_threads(1)
    try:
        ratios = []
        for i in range(repeats + 1):
            if setup is not None:
                setup()
            t1 = _probe_job()
            t = time.perf_counter()
            fn()
            if i:  # the first run warms up
                ratios.append((time.perf_counter() - t) / t1)
        return statistics.median(ratios)
    finally:
        torch.set_num_threads(threads)
        if before is None:
            os.environ.pop("SYNCD_NUM_THREADS", None)
        else:
            os.environ["SYNCD_NUM_THREADS"] = before


_FORKED = None  # the job forked workers run (set just before the fork; see _parallel_cores)


def _forked(_=None) -> float:
    t = time.perf_counter()
    _FORKED()
    return time.perf_counter() - t


def _parallel_cores(fn, k: int, tries: int = 5, timeout_s: float = 120.0) -> float | None:
    """The cores ``k`` forked processes running ``fn`` at once get together: ``k`` times its seconds alone over
    their mean seconds (median of ``tries``). Unlike :func:`cpu_probe`'s compute-bound job, this sees the memory
    traffic ``k`` engines share. Forked with torch and the codec on one thread (a forked OpenMP pool hangs); None
    if a try does not end within ``timeout_s``."""
    import multiprocessing

    global _FORKED
    threads, before = torch.get_num_threads(), os.environ.get("SYNCD_NUM_THREADS")
    torch.set_num_threads(1)
    os.environ["SYNCD_NUM_THREADS"] = "1"
    _FORKED, ctx = fn, multiprocessing.get_context("fork")
    got = []
    try:
        for _ in range(tries):
            with ctx.Pool(1) as pool:
                alone = pool.map_async(_forked, [0]).get(timeout_s)[0]
            with ctx.Pool(k) as pool:
                got.append(k * alone / statistics.mean(pool.map_async(_forked, range(k)).get(timeout_s)))
    except multiprocessing.TimeoutError:
        return None
    finally:
        _FORKED = None
        torch.set_num_threads(threads)
        if before is None:
            os.environ.pop("SYNCD_NUM_THREADS", None)
        else:
            os.environ["SYNCD_NUM_THREADS"] = before
    return min(float(os.cpu_count() or 1), statistics.median(got))


def measure_costs(params: int, tensor_params: int, density: float, fmt: int, repeats: int, seed: int = 0,
                  engines: int = 4) -> dict:
    """The cost of every operation the stages run, per byte of bf16 weights in probe units (:func:`_units`; SHA-256
    per byte of shard data), on ``params`` synthetic weights in tensors of ``tensor_params`` with an Adam-like step
    changing ``density`` of the bf16 words: the publisher's snapshot copy, finite check and encode, and a headless
    engine's own ``stage``, ``apply`` and ``checksum`` (``syncd.engine.StateDictEngine``, as the engine processes
    run them); with the delta's bytes and changed words per parameter, ``stage_cores``: the cores ``engines``
    engines staging at once get together (:func:`_parallel_cores`; None if it could not be measured: then the
    versions' probes stand in), and ``pause_cores``: the cores an engine's apply and checksum get on their own,
    with the codec's threads (their one-thread time over their time so). :func:`rates_now` turns them into a
    :class:`Rates`."""
    from bench.projection import weight_delta
    from syncd.engine.state_dict import StateDictEngine
    from syncd.engines.update import Update
    from syncd.ops import checksum, delta
    from syncd.publish.finite import check_finite

    w_old, w_new = weight_delta(params, density, seed=seed)
    olds = {f"t{i}": t for i, t in enumerate(w_old.to(torch.bfloat16).split(tensor_params))}
    news = {f"t{i}": t for i, t in enumerate(w_new.to(torch.bfloat16).split(tensor_params))}
    nbytes = 2 * w_old.numel()
    blobs = delta.encode_many(list(olds.values()), list(news.values()), backend="cpu", version=fmt)
    data = b"".join(bytes(b) for b in blobs)
    update = Update(1, "delta", dict(zip(olds, blobs)), 0, {n: checksum(t) for n, t in news.items()})
    engine = StateDictEngine({n: t.clone() for n, t in olds.items()}, 0)

    def staged():
        if engine.version == 1:
            engine.rollback()
            engine.resume()
        engine.stage(update)
        engine.pause()

    held: list = []  # an engine keeps the last applied update (for rollback) while it stages the next one

    def stage():
        engine.stage(update)
        held.append(engine.updater.staged)
        del held[:-2]

    bufs = [torch.empty_like(t) for t in news.values()]
    changed = sum(int((o.view(torch.int16) != n.view(torch.int16)).sum()) for o, n in zip(olds.values(), news.values()))
    units = {
        "encode": _units(lambda: delta.encode_many(list(olds.values()), list(news.values()), backend="cpu",
                                                   version=fmt), repeats),
        "stage": _units(stage, repeats),
        "decode": _units(lambda: [delta.changes(b, base=o) for o, b in zip(olds.values(), blobs)], repeats),
        "apply": _units(engine.apply, repeats, setup=staged),
        "checksum": _units(engine.checksum, repeats),
        "copy": _units(lambda: [b.copy_(n) for b, n in zip(bufs, news.values())], repeats),
        "finite": _units(lambda: check_finite(news), repeats),
    }
    pause_all = (_units(engine.apply, repeats, setup=staged, native_threads="")
                 + _units(engine.checksum, repeats, native_threads=""))
    classes = sum((o.numel() + 1) // 2 for b, o in zip(blobs, olds.values()) if delta.inspect(b)["context_blocks"])
    fresh = lambda: StateDictEngine({n: t.clone() for n, t in olds.items()}, 0).stage(update)  # noqa: E731
    return {"delta_bytes_per_param": len(data) / w_old.numel(), "changed_per_param": changed / w_old.numel(),
            "class_bytes_per_param": classes / w_old.numel(), "stage_cores": _parallel_cores(fresh, engines),
            "pause_cores": (units["apply"] + units["checksum"]) / pause_all,
            "units_per_byte": {**{k: u / nbytes for k, u in units.items()},
                               "sha256": _units(lambda: hashlib.sha256(data).digest(), repeats) / len(data)}}


def rates_now(costs: dict, t1: float) -> Rates:
    """The one-core :class:`Rates` of ``costs`` (:func:`measure_costs`) when the probe job takes ``t1`` seconds."""
    return Rates(delta_bytes_per_param=costs["delta_bytes_per_param"], changed_per_param=costs["changed_per_param"],
                 class_bytes_per_param=costs["class_bytes_per_param"],
                 **{k: 1.0 / (u * t1) for k, u in costs["units_per_byte"].items()})


def measured_stages(tl: dict) -> dict:
    """Seconds of each stage of one version from its timeline (:meth:`SimCluster.timeline`): contiguous intervals
    between the ends of ``encode`` (``publish()`` called to the manifest write's return less the publisher's
    ``upload_s``), ``upload`` (the manifest written), ``long link`` (the last shard read from the store, by the
    root's ``store_read`` event), ``broadcast`` (the last node's ``delivered``), ``stage`` (the last engine's pause
    began: the daemon's ``done_at`` less its ``pause_s``) and ``pause`` (the last ``done_at``); ``total`` from
    ``publish()`` to the last engine serving."""
    pub, nodes = tl["publish"], list(tl["nodes"].values())
    t_call, t_commit = pub["t_call"], pub["t_commit"]
    t_enc = t_commit - pub["upload_s"]
    reads = [t for n in nodes for t, _, _ in n["store_reads"]]
    t_read = max(reads) if reads else min(n["plan"] for n in nodes)
    t_deliv = max(n["delivered"] for n in nodes)
    t_pause = max(n["update"]["done_at"] - max(n["update"]["pause_s"].values()) for n in nodes)
    t_done = max(n["update"]["done_at"] for n in nodes)
    ends = [t_call, t_enc, t_commit, t_read, t_deliv, t_pause, t_done]
    out = {s: ends[i + 1] - ends[i] for i, s in enumerate(STAGES)}
    out["total"] = t_done - t_call
    return out


# ---------------------------------------------------------------------------------------------- one size


def cluster_setup(params: int, a) -> dict:
    """The simulated deployment of a model of ``params`` parameters (see the module docstring): link rates in
    bits per second scaled with the size, the publisher's tensors and shards, the cluster's chunk."""
    long_bps = a.long_mbit * 1e6 * params / 1e8
    return {"params": params, "nodes": a.nodes, "long_bps": long_bps, "upload_bps": long_bps * a.upload_ratio,
            "intra_bps": long_bps * a.intra_ratio, "tensor_params": max(1 << 16, params // 64 // 1024 * 1024),
            "shard_bytes": max(1 << 16, params // 100), "chunk_bytes": a.chunk_kib << 10,
            "poll_s": a.cluster_poll_s, "fanout": a.fanout, "format": 1}


def model_setup(cfg: dict, manifest_bytes: float, cpu: dict, stage_cores: float, pause_cores: float,
                hop_s: float) -> Setup:
    """The model's :class:`Setup` for a simulated deployment: its shaped rates and settings; the cores the trainer's
    two encode threads get (``cpu``: a :func:`cpu_probe` around the version), those each node gets while every
    node's engine stages at once (``stage_cores`` for them all) and those the last engine's pause gets on its own
    (``pause_cores``; both from :func:`measure_costs`); ``hop_s``: a tree level's overhead, as in the projection."""
    return Setup(params=cfg["params"], trainer_hosts=1, trainer_cores=cpu["cores"]["2"],
                 upload_Bps=link_Bps(cfg["upload_bps"]), long_Bps=link_Bps(cfg["long_bps"]),
                 intra_Bps=link_Bps(cfg["intra_bps"]),
                 nodes=cfg["nodes"], fanout=cfg["fanout"], chunk_bytes=cfg["chunk_bytes"],
                 shard_bytes=cfg["shard_bytes"], tensor_params=cfg["tensor_params"], poll_s=cfg["poll_s"],
                 manifest_bytes=manifest_bytes, hop_s=hop_s, engine="cpu", node_cores=stage_cores / cfg["nodes"],
                 pause_cores=pause_cores, scrub_bytes=SCRUB_BYTES)


def _probe_mean(a: dict, b: dict) -> dict:
    return {"t1": (a["t1"] + b["t1"]) / 2, "cores": {k: (a["cores"][k] + b["cores"][k]) / 2 for k in a["cores"]}}


def run_size(cfg: dict, densities: list[float], a, workdir: Path, hop_s: float) -> dict:
    """One cluster for one size: a full version unshaped, the one-core rates, then every density ``a.validate_repeats``
    times on the shaped links; per version its timeline, measured stages and the CPU probes around it."""
    from bench.netsim.cluster import SimCluster

    schedule = [d for _ in range(a.validate_repeats) for d in densities]
    sample = min(cfg["params"], a.sample_params)
    ks = sorted({2, cfg["nodes"]})
    out = {"config": cfg, "versions": [], "costs": {}, "hop_s": hop_s}
    t0 = time.monotonic()
    with SimCluster(workdir, cfg["nodes"], params=cfg["params"], densities=schedule, shard_bytes=cfg["shard_bytes"],
                    tensor_elems=cfg["tensor_params"], delta_format=cfg["format"], poll_s=cfg["poll_s"],
                    chunk_bytes=cfg["chunk_bytes"], fanout=cfg["fanout"]) as c:
        first = c.publish(0)
        c.wait_served(first["version"])
        out["setup_s"] = time.monotonic() - t0
        for d in densities:  # measured here while the cluster idles
            out["costs"][str(d)] = measure_costs(sample, min(cfg["tensor_params"], sample), d, cfg["format"],
                                                 a.rate_repeats, engines=cfg["nodes"])
        c.shape(upload_bps=cfg["upload_bps"], long_bps=cfg["long_bps"], intra_bps=cfg["intra_bps"])
        for k, d in enumerate(schedule, 1):
            before = cpu_probe(ks)
            rec = c.publish(k)
            c.wait_served(rec["version"])
            tl = c.timeline(rec["version"])
            out["versions"].append({"density": d, "density_measured": rec["density_measured"],
                                    "delta_bytes": rec["bytes"], "manifest_bytes": rec["manifest_bytes"],
                                    "stages_s": measured_stages(tl), "cpu": _probe_mean(before, cpu_probe(ks)),
                                    "timeline": tl})
    out["run_s"] = time.monotonic() - t0
    return out


def predict(res: dict, v: dict) -> dict:
    """The model's stages for version ``v`` of a size's run ``res``: the costs measured in the run at the speed and
    with the cores this machine's CPUs gave around ``v`` (its probes)."""
    costs = res["costs"][str(v["density"])]
    rates = rates_now(costs, v["cpu"]["t1"])
    # how many cores concurrent engines get is one property of the machine: the median over the densities
    measured = [c["stage_cores"] for c in res["costs"].values() if c["stage_cores"]]
    cores = statistics.median(measured) if measured else v["cpu"]["cores"][str(res["config"]["nodes"])]
    pause = statistics.median(c["pause_cores"] for c in res["costs"].values())
    return stages(model_setup(res["config"], v["manifest_bytes"], v["cpu"], cores, pause, res["hop_s"]), rates)


def compare(res: dict) -> list[dict]:
    """Validation rows of one size: per density and stage (and ``total``), the median measured seconds against
    the median of the model's predictions for the same versions, and ``spread``: how far the repeats agree with
    each other (the longest over the shortest; 1 for one repeat)."""
    cfg, rows = res["config"], []
    for d in res["costs"]:
        vs = [v for v in res["versions"] if str(v["density"]) == d]
        preds = [predict(res, v) for v in vs]
        for stage in (*STAGES, "total"):
            m = statistics.median(v["stages_s"][stage] for v in vs)
            p = statistics.median(q["total_s"] if stage == "total" else q["stages_s"][stage] for q in preds)
            every = [v["stages_s"][stage] for v in vs]
            rows.append({"params": cfg["params"], "density": float(d), "nodes": cfg["nodes"], "stage": stage,
                         "measured_s": m, "predicted_s": p, "ratio": p / m if m > 0 else float("inf"),
                         "measured_all_s": every,
                         "spread": max(every) / min(every) if min(every) > 0 else float("inf")})
    return rows


def validate(a, hop_s: float = 0.0) -> dict:
    """Every size of ``a.validate_params`` at every density of ``a.validate_densities`` (see the module docstring);
    ``hop_s``: the tree level overhead the projection assumes.
    Returns ``{"validation": rows, "runs": per size}``."""
    densities = [float(x) for x in a.validate_densities.split(",")]
    runs, rows = [], []
    with tempfile.TemporaryDirectory(prefix="syncd-validate-") as tmp:
        work = Path(a.validate_workdir or tmp)
        for i, p in enumerate(int(float(x)) for x in a.validate_params.split(",")):
            res = run_size(cluster_setup(p, a), densities, a, work / f"size{i}", hop_s)
            runs.append(res)
            rows += compare(res)
    return {"validation": rows, "runs": runs}


def accuracy(validation: list[dict]) -> dict:
    """How far the model is from the validation runs: the predicted/measured range of the stages and of the totals,
    the share within [0.8, 1.25], and whether every stage and total is (``goal_met``). Beside it, the measurement's
    own repeatability: ``repeatable_rows``, the rows whose repeats agree within 1.25 (``spread``), and
    ``repeatable_within_0.8_1.25``, the share of those the model predicts within [0.8, 1.25] (None if no row
    repeats that well). A model cannot be held to ±25% of a stage whose repeats differ by more."""
    ok = lambda r: 0.8 <= r["ratio"] <= 1.25  # noqa: E731
    totals = [r for r in validation if r["stage"] == "total"]
    parts = [r for r in validation if r["stage"] != "total"]
    steady = [r for r in validation if r["spread"] <= 1.25]
    return {"total_ratio_range": [min(r["ratio"] for r in totals), max(r["ratio"] for r in totals)],
            "stage_ratio_range": [min(r["ratio"] for r in parts), max(r["ratio"] for r in parts)],
            "within_0.8_1.25": sum(map(ok, validation)) / len(validation), "goal_met": all(map(ok, validation)),
            "repeatable_rows": len(steady),
            "repeatable_within_0.8_1.25": sum(map(ok, steady)) / len(steady) if steady else None}


def run(a, hop_s: float = 0.0) -> dict | None:
    """``--validate``: :func:`validate`, its table printed and its :func:`accuracy` added (``"accuracy"``); None,
    after saying why on stderr, where network namespaces cannot be made."""
    import sys

    from bench.netsim import netns_available

    why = netns_available()
    if why:
        print(f"bench.projection --validate needs network namespaces: {why}", file=sys.stderr)
        return None
    res = validate(a, hop_s)
    print(f"\nvalidation (real path in network namespaces, {a.nodes} nodes; predicted / measured, medians of "
          f"{a.validate_repeats}):")
    print(f"{'params':>8} {'density':>7} {'stage':>10} {'measured':>9} {'predicted':>9} {'ratio':>6} {'spread':>6}")
    for r in res["validation"]:
        print(f"{r['params']:8.3g} {100 * r['density']:6.2f}% {r['stage']:>10} {r['measured_s']:8.3f}s "
              f"{r['predicted_s']:8.3f}s {r['ratio']:6.2f} {r['spread']:6.2f}")
    res["accuracy"] = accuracy(res["validation"])
    return res
