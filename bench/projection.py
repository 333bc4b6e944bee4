"""Projection: from publish() to every engine of a remote cluster serving a 1T-parameter update, stage by stage.

Rates measured in this run, on this machine, one core each: the codec's encode, apply and host decode (format 1 and 2) on
weight-like bf16 deltas at each density of ``shared/notes/deltas.md``'s table, and on the NVFP4 codes and
block scales of the same weights; the checksum; and the broadcast tree's cost per hop (``bench.broadcast``,
a real cluster of node processes on loopback, N = 2 and 4: the completion added by one more tree level).
Everything else is a stated assumption (flags below, printed with every figure): hosts and cores, link
rates between regions and inside the cluster, GPUs per engine, PCIe and HBM rates.

The stages, for one version (sizes from the measured bytes per parameter at that density):
``encode`` on the trainer hosts (each its share of the weights, its cores in parallel, capped by its memory
bandwidth), ``upload`` to the object store (each host its share of the delta), ``long link`` (the remote
cluster reads every byte once), ``broadcast`` (a fanout tree over the cluster's nodes: bytes over the
intra-cluster link, plus a measured overhead per tree level), ``stage`` (while its engines serve, each node
decodes the deltas of the weights its GPUs hold on its host cores into positions and values, at the measured
host-decode rate; format 2 first copies the old weights' classes, half a byte per weight of a tensor with context blocks, from
each GPU; each
GPU copies and checksums its base and result at HBM rate) and ``pause``
(each GPU receives its staged changed words, 6 bytes each, over PCIe and scatters them in HBM, a read and a
write of a 32-byte sector each). An engine on CPUs would stage with the apply and checksum rates against
its weights in host memory instead (in the JSON, ``stage_cpu_engine_s``). Sequential is the sum;
pipelined assumes shards flow through the stages concurrently (the longest stage plus one shard's time
through each of the others). Writes JSON (``--json``); ``--plot`` draws a PNG.

    python -m bench.projection                         # the notes' densities, 1T parameters, 10 Gb/s long link
    python -m bench.projection --sample-mib 4 --densities 0.01 --hop-overhead-s 0.006   # seconds
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

from bench._report import Row, finish, output_flags
from bench._timing import Stopwatch, median_time
from syncd.ops import checksum_many, delta, nvfp4

# the dense AdamW rows of the notes' table (policy gradient, lr 1e-6 / 3e-6 / 1e-5, K = 1, 2, 4, 8), and 1%
NOTES_DENSITIES = (0.0083, 0.01, 0.0145, 0.024, 0.025, 0.041, 0.042, 0.063, 0.07, 0.105, 0.117, 0.172, 0.268)


# ---------------------------------------------------------------------------------------------- measured


def weight_delta(n: int, density: float, seed: int = 0):
    """fp32 master weights (normal, std 0.02) and an Adam-like step (a random sign times a step size times
    U(0.5, 1.5)) whose size is set so that ``density`` of the bf16 words change, as on real RL deltas: small
    weights change more often and by more units in the last place."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, generator=g) * 0.02
    move = torch.randn(n, generator=g).sign() * (0.5 + torch.rand(n, generator=g))
    probe = slice(0, min(n, 1 << 20))
    lo, hi = -30.0, 0.0  # log2 of the step size, bisected on a probe
    for _ in range(40):
        mid = (lo + hi) / 2
        got = ((w[probe] + move[probe] * 2.0 ** mid).to(torch.bfloat16) != w[probe].to(torch.bfloat16)).float().mean()
        lo, hi = (mid, hi) if got < density else (lo, mid)
    return w, w + move * 2.0 ** ((lo + hi) / 2)


def one_core(fn, repeats: int, setup=None) -> float:
    """Median seconds of ``fn`` with the native codec on one thread (``setup``, untimed, before each call)."""
    before = os.environ.get("SYNCD_NUM_THREADS")
    os.environ["SYNCD_NUM_THREADS"] = "1"
    try:
        return median_time(fn, repeats, setup=setup, warmup=1)
    finally:
        if before is None:
            os.environ.pop("SYNCD_NUM_THREADS")
        else:
            os.environ["SYNCD_NUM_THREADS"] = before


def host_decode(blobs: list, olds: list):
    """What an engine whose weights are on GPUs does on its host: parse each blob into positions and values
    (``delta.changes``; format 2 with its base, whose classes a GPU computes and copies over, half a byte
    each: the host decodes those as fast as it reads them from the base)."""
    return lambda: [delta.changes(b, base=o) for b, o in zip(blobs, olds)]


def codec_rates(olds: list, news: list, repeats: int) -> dict:
    """Per format: delta bytes and, on one core, the seconds of encode, apply (in place on host weights,
    verified) and the host decode of an engine on GPUs (:func:`host_decode`), for tensors ``olds`` -> ``news``."""
    out = {}
    work = [o.clone() for o in olds]

    def reset():
        for w, o in zip(work, olds):
            w.copy_(o)
    for v in (1, 2):
        blobs = delta.encode_many(olds, news, backend="cpu", version=v)
        enc = one_core(lambda: delta.encode_many(olds, news, backend="cpu", version=v), repeats)
        app = one_core(lambda: delta.apply_many(work, blobs, backend="cpu"), repeats, setup=reset)
        if not all(torch.equal(w.view(torch.uint8), n.view(torch.uint8)) for w, n in zip(work, news)):
            raise AssertionError(f"format {v} round trip failed")
        unpack = one_core(host_decode(blobs, olds), repeats)
        # the GPUs compute classes only for tensors with context blocks (float dtypes)
        class_bytes = sum((o.numel() + 1) // 2 for b, o in zip(blobs, olds) if delta.inspect(b)["context_blocks"])
        out[str(v)] = {"bytes": sum(map(len, blobs)), "encode_s": enc, "apply_s": app, "host_decode_s": unpack,
                       "class_bytes": class_bytes}
    return out


def _words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's words as integers (a bf16 word, an NVFP4 byte of two codes, a float8 scale)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def measure_codecs(densities, sample_mib: float, repeats: int) -> list[dict]:
    """bf16 and NVFP4 deltas at each density: bytes per parameter and one-core rates, both formats."""
    n = int(sample_mib * (1 << 20)) // 2 // 4096 * 4096
    rows = []
    for i, d in enumerate(densities):
        w_old, w_new = weight_delta(n, d, seed=i)
        old, new = w_old.to(torch.bfloat16), w_new.to(torch.bfloat16)
        bf = codec_rates([old], [new], repeats)
        # NVFP4 of the same weights (per-tensor scale from each, as a trainer exports them): codes and scales
        qo, qn = nvfp4.quantize(w_old.view(-1, 4096)), nvfp4.quantize(w_new.view(-1, 4096))
        parts_o, parts_n = [qo.qdata, qo.scales], [qn.qdata, qn.scales]
        fp = codec_rates(parts_o, parts_n, repeats)
        changed = lambda a, b: (_words(a) != _words(b)).sum().item()  # noqa: E731
        rows.append({
            "density": d, "density_measured": changed(old, new) / n, "params": n,
            "bf16": {"weight_bytes": 2 * n, **bf},
            "nvfp4": {"weight_bytes": sum(t.numel() * t.element_size() for t in parts_o), **fp,
                      "codes_changed": changed(qo.qdata, qn.qdata) / qo.qdata.numel(),
                      "scales_changed": changed(qo.scales, qn.scales) / qo.scales.numel(),
                      "changed_words_per_param": (changed(qo.qdata, qn.qdata) + changed(qo.scales, qn.scales)) / n},
        })
    return rows


def checksum_rate(sample_mib: float, repeats: int) -> float:
    """Bytes per second of the checksum on one core."""
    x = torch.randint(0, 256, (int(sample_mib * (1 << 20)),), dtype=torch.uint8)
    return x.numel() / one_core(lambda: checksum_many([x]), repeats)


def hop_overhead(repeats: int) -> dict:
    """The broadcast benchmark's completion for N = 2 and 4 nodes on loopback (fanout 2: tree depth 1 and 2);
    the difference is what one more tree level adds."""
    from bench import broadcast

    with tempfile.TemporaryDirectory(prefix="syncd-proj-") as tmp:
        out = Path(tmp) / "broadcast.json"
        with contextlib.redirect_stdout(io.StringIO()):  # its own table: the JSON below keeps what we use
            broadcast.main(["--nodes", "2,4", "--size-mib", "1", "--repeats", str(max(1, repeats)), "--mode",
                            "unshaped", "--json", str(out)])
        res = json.loads(out.read_text())["modes"]["unshaped"]
    comp = {r["nodes"]: r["completion_s"] for r in res["rows"]}
    return {"completion_s": comp, "shard_bytes": res["S_bytes"], "per_hop_s": max(0.0, comp[4] - comp[2])}


# ---------------------------------------------------------------------------------------------- projected


def tree_depth(nodes: int, fanout: int) -> int:
    """Levels below the root of a fanout tree over ``nodes`` positions (heap order, as the planner builds)."""
    depth, p = 0, nodes - 1
    while p > 0:
        p = (p - 1) // fanout
        depth += 1
    return depth


def rates_of(m: dict, fmt_v: str, sliced: float) -> dict:
    """Bytes and one-core seconds of ``m``'s weights (a measured row's "bf16" or "nvfp4") in format ``fmt_v``. Format
    2 decodes only where an engine holds a tensor whole, so the share ``sliced`` of the weights that engines hold in
    tensor-parallel slices stays in format 1 (``WeightPublisher(sliced_tensors=)``): its bytes and times mix."""
    if fmt_v == "1" or sliced <= 0:
        return m[fmt_v]
    f1, f2 = m["1"], m["2"]
    mix = {k: sliced * f1[k] + (1 - sliced) * f2[k] for k in ("bytes", "encode_s", "apply_s", "host_decode_s")}
    mix["class_bytes"] = (1 - sliced) * f2["class_bytes"]
    return mix


def project(row: dict, kind: str, fmt_v: str, a: argparse.Namespace, ck_bps: float, hop_s: float) -> dict:
    """Stage times (seconds) for ``a.params`` parameters of ``kind`` ("bf16" / "nvfp4") in format ``fmt_v`` (with
    format 2, the ``a.sliced_fraction`` of them in format 1)."""
    m = row[kind]
    f = rates_of(m, fmt_v, a.sliced_fraction)
    per_param = m["weight_bytes"] / row["params"]  # weight bytes per parameter
    weights = a.params * per_param
    delta_bytes = a.params * f["bytes"] / row["params"]
    enc_bps = m["weight_bytes"] / f["encode_s"]  # bytes of weights per second, one core
    app_bps = m["weight_bytes"] / f["apply_s"]
    dec_bps = m["weight_bytes"] / f["host_decode_s"]
    host = lambda core_bps, touched: min(core_bps * a.cores_per_host, a.host_mem_gbps * 1e9 / touched)  # noqa: E731
    gpus = a.gpus_per_engine_bf16 if kind == "bf16" else a.gpus_per_engine_nvfp4
    node_weights = weights * min(1.0, a.gpus_per_node / gpus)  # what one node's GPUs hold
    depth = tree_depth(a.cluster_nodes, a.fanout)
    changed = a.params * (row["density_measured"] if kind == "bf16" else m["changed_words_per_param"])
    changed_per_gpu = changed / gpus
    stages = {
        "encode": weights / a.trainer_hosts / host(enc_bps, 2.0),  # reads old and new
        "upload": delta_bytes / a.trainer_hosts / (a.upload_gbit * 1e9 / 8),
        "long link": delta_bytes / (a.long_gbit * 1e9 / 8),
        "broadcast": delta_bytes * a.node_fraction / (a.intra_gbit * 1e9 / 8) + depth * hop_s,
        "stage": node_weights / (dec_bps * a.cores_per_host)  # host decode of the node's deltas
        + node_weights * f["class_bytes"] / m["weight_bytes"] / a.gpus_per_node / (a.pcie_gbps * 1e9)
        + 4 * node_weights / a.gpus_per_node / (a.hbm_gbps * 1e9),  # scratch copy, base and result checksums
        "pause": changed_per_gpu * a.staged_bytes_per_change / (a.pcie_gbps * 1e9)
        + changed_per_gpu * 64 / (a.hbm_gbps * 1e9),
    }
    shard = a.shard_mib * (1 << 20)
    chunks = max(1.0, delta_bytes / shard)  # shards flowing through the stages
    longest = max(stages, key=stages.get)
    pipelined = stages[longest] + sum(t / chunks for k, t in stages.items() if k not in (longest, "pause"))
    if longest != "pause":
        pipelined += stages["pause"]  # engines pause once the last shard is staged
    cpu_stage = node_weights / host(app_bps, 2.0) + 2 * node_weights / host(ck_bps, 1.0)
    return {"kind": kind, "format": int(fmt_v), "density": row["density"], "weights_bytes": weights,
            "stage_cpu_engine_s": cpu_stage,
            "delta_bytes": delta_bytes, "delta_pct": 100 * delta_bytes / weights, "changed": changed,
            "stages_s": stages, "sequential_s": sum(stages.values()), "pipelined_s": pipelined,
            "dominant": longest, "pause_s": stages["pause"], "tree_depth": depth}


# ---------------------------------------------------------------------------------------------- main


ASSUMPTIONS = (  # flag, default, meaning
    ("params", 1e12, "parameters of the model"),
    ("trainer-hosts", 128, "trainer hosts encoding in parallel (each its share of the weights)"),
    ("cores-per-host", 32, "cores per host the codec uses (trainer hosts and engine nodes)"),
    ("host-mem-gbps", 200.0, "memory bandwidth of a host in GB/s (caps the codec: bytes touched per byte)"),
    ("upload-gbit", 25.0, "each trainer host's link to the object store, Gb/s"),
    ("long-gbit", 10.0, "the long link between regions, Gb/s (the remote cluster reads every byte once)"),
    ("intra-gbit", 100.0, "links inside the remote cluster, Gb/s per node"),
    ("cluster-nodes", 64, "nodes of the remote cluster"),
    ("fanout", 2, "broadcast tree fanout"),
    ("node-fraction", 1.0, "share of the delta every node receives (1: every node gets every shard)"),
    ("gpus-per-node", 8, "GPUs per node"),
    ("gpus-per-engine-bf16", 16, "GPUs per engine for bf16 weights (2 TB of HBM for 1T parameters)"),
    ("gpus-per-engine-nvfp4", 8, "GPUs per engine for NVFP4 weights"),
    ("pcie-gbps", 40.0, "host-to-GPU copy rate per GPU, GB/s (PCIe 5 x16, achieved)"),
    ("hbm-gbps", 3500.0, "GPU memory bandwidth, GB/s (H200, achieved)"),
    ("staged-bytes-per-change", 6.0, "bytes per changed word sent to the GPU in the pause (int32 position + word)"),
    ("shard-mib", 64.0, "shard size flowing through the stages when pipelined"),
    ("sliced-fraction", 0.05, "share of the weights engines hold in tensor-parallel slices, which stay in format 1 "
                              "when format 2 is chosen (an MoE with expert-parallel experts and tensor-parallel "
                              "attention and embeddings)"),
)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.projection", description=__doc__.split("\n\n")[0])
    for flag, default, meaning in ASSUMPTIONS:
        p.add_argument(f"--{flag}", type=type(default), default=default, help=f"assumption: {meaning}")
    p.add_argument("--densities", default=",".join(map(str, NOTES_DENSITIES)), help="fractions of changed bf16 words")
    p.add_argument("--sample-mib", type=float, default=64.0, help="bf16 bytes of each measured delta")
    p.add_argument("--repeats", type=int, default=3, help="timing repeats (medians)")
    p.add_argument("--hop-overhead-s", type=float, help="skip the broadcast measurement and assume this per hop")
    p.add_argument("--goal-s", type=float, default=60.0)
    p.add_argument("--pause-goal-s", type=float, default=1.0)
    output_flags(p, "projection")
    return p


def rows(projections: list[dict], params: float) -> list[Row]:
    """The shared columns: per kind, format and density, the projected seconds from publish() to every engine
    serving, pipelined, against the same stages one after another (projected from rates measured here)."""
    return [Row(f"{q['kind']} format {q['format']} (projected)", q["pipelined_s"], q["sequential_s"] / q["pipelined_s"],
                "stages one after another", f"{params:.0e} params {100 * q['density']:.3g}%", "-")
            for q in projections]


def plot(projections: list[dict], a, path) -> None:
    from bench._plot import pyplot, save

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, kind in zip(axes, ("bf16", "nvfp4")):
        ps = [q for q in projections if q["kind"] == kind and q["format"] == 2]
        x = list(range(len(ps)))
        bottom = [0.0] * len(ps)
        for stage in ps[0]["stages_s"]:
            vals = [q["stages_s"][stage] for q in ps]
            ax.bar(x, vals, bottom=bottom, label=stage)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.plot(x, [q["pipelined_s"] for q in ps], "k.-", label="pipelined")
        ax.axhline(a.goal_s, color="red", lw=0.8, ls="--", label=f"goal {a.goal_s:g} s")
        ax.set_xticks(x, [f"{100 * q['density']:.3g}%" for q in ps], rotation=45)
        ax.set(title=f"{a.params:.0e} parameters, {kind}, format 2", xlabel="changed bf16 words",
               ylabel="seconds from publish() to serving")
    axes[0].legend(fontsize=8)
    save(fig, path, dpi=120)


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    if not 0.0 <= a.sliced_fraction <= 1.0:
        print(f"bench.projection: --sliced-fraction must be in [0, 1], got {a.sliced_fraction}", file=sys.stderr)
        return 2
    densities = [float(x) for x in a.densities.split(",")]
    t0 = Stopwatch()
    measured = measure_codecs(densities, a.sample_mib, a.repeats)
    ck_bps = checksum_rate(a.sample_mib, a.repeats)
    hop = {"per_hop_s": a.hop_overhead_s, "assumed": True} if a.hop_overhead_s is not None else hop_overhead(a.repeats)
    assumptions = {flag: getattr(a, flag.replace("-", "_")) for flag, _, _ in ASSUMPTIONS}
    print(f"syncd projection: measured here in {t0.elapsed:.0f}s (one core each): checksum "
          f"{ck_bps / 1e9:.2f} GB/s; broadcast hop {1e3 * hop['per_hop_s']:.1f} ms"
          f"{' (assumed)' if hop.get('assumed') else ' (bench.broadcast, loopback, N=2 vs 4)'}")
    print("assumptions: " + ", ".join(f"{k} {v:g}" for k, v in assumptions.items()))
    projections = [project(r, kind, v, a, ck_bps, hop["per_hop_s"]) for r in measured for kind in ("bf16", "nvfp4")
                   for v in ("1", "2")]
    stages = list(projections[0]["stages_s"])
    print(f"\n{'kind':>5} {'fmt':>3} {'density':>7} {'delta':>9} {'enc GB/s/core':>13} " +
          " ".join(f"{s:>9}" for s in stages) + f" {'sequential':>10} {'pipelined':>9}  dominant")
    for r, q in zip([r for r in measured for _ in range(4)], projections):
        m = rates_of(r[q["kind"]], str(q["format"]), a.sliced_fraction)
        print(f"{q['kind']:>5} {q['format']:>3} {100 * q['density']:6.2f}% {q['delta_bytes'] / 1e9:7.2f}GB "
              f"{r[q['kind']]['weight_bytes'] / m['encode_s'] / 1e9:13.2f} " +
              " ".join(f"{q['stages_s'][s]:8.2f}s" for s in stages) +
              f" {q['sequential_s']:9.1f}s {q['pipelined_s']:8.1f}s  {q['dominant']}")
    goal = min((q for q in projections if q["kind"] == "bf16" and q["format"] == 2),
               key=lambda q: abs(q["density"] - 0.01))
    ok = goal["pipelined_s"] <= a.goal_s and goal["pause_s"] <= a.pause_goal_s
    v1 = next(q for q in projections if q["kind"] == "bf16" and q["format"] == 1 and q["density"] == goal["density"])
    print(f"\ngoal ({a.params:.0e} bf16 at {100 * goal['density']:.2g}% over {a.long_gbit:g} Gb/s, format 2): "
          f"{goal['pipelined_s']:.1f}s pipelined ({goal['sequential_s']:.1f}s sequential; goal {a.goal_s:g}s), "
          f"pause {goal['pause_s']:.3f}s per engine (goal {a.pause_goal_s:g}s): {'met' if ok else 'NOT met'}; "
          f"dominant stage: {goal['dominant']} ({goal['stages_s'][goal['dominant']]:.1f}s); format 1: "
          f"{v1['pipelined_s']:.1f}s ({v1['dominant']} {v1['stages_s'][v1['dominant']]:.1f}s)")
    out = {"bench": "projection", "assumptions": assumptions, "checksum_bytes_per_s": ck_bps, "broadcast": hop,
           "measured": measured, "projections": projections, "goal": {"case": goal, "met": ok}}
    return finish("projection", args=a, out=out, rows=rows(projections, a.params),
                  draw=lambda path: plot(projections, a, path))


if __name__ == "__main__":
    sys.exit(main())
