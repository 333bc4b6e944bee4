"""Projection: from publish() to every engine of a remote cluster serving a 1T-parameter update, stage by stage.

The model (:mod:`bench._projection_model`) follows one version along the real path, stage after stage -- the
publisher commits a version only once every shard is up, the cluster's controller plans only committed versions,
a daemon stages only a version all of whose shards are in its cache -- so the total is the sum of ``encode``,
``upload``, ``long link``, ``broadcast``, ``stage`` and ``pause``, each with what overlaps inside it (encode with
the uploads it waits for, the long link with the tree). ``--validate`` checks it against real runs first
(:mod:`bench._projection_validate`): the real path in network namespaces on shaped links at several model sizes
and densities, each stage timed from the processes' own records against the model fed the same configuration.

Rates measured in this run, on this machine, one core each: the codec's encode, apply and host decode (format 1 and
2) on weight-like bf16 deltas at each density of ``shared/notes/deltas.md``'s table, and on the NVFP4 codes and
block scales of the same weights; the checksum, SHA-256 and copy rates; and the broadcast tree's cost per level
(``bench.broadcast`` on loopback, N = 2 and 4; or ``--hop-overhead-s``). Everything else is a stated assumption
(flags below, printed with every figure): hosts and cores, link rates between regions and inside the cluster, GPUs
per engine, PCIe and HBM rates, shard and chunk sizes, the controller's poll. Engines are on GPUs: a node's host
decodes its GPUs' deltas (one process per GPU), format 2 first copies the old weights' classes from each GPU, each
GPU copies and checksums its base and result at HBM rate; the pause sends 6 bytes per changed word over PCIe,
scatters them and checksums the weights (the daemon's check). Writes JSON (``--json``); ``--plot`` draws a PNG.

    python -m bench.projection                         # the notes' densities, 1T parameters, 10 Gb/s long link
    python -m bench.projection --sample-mib 4 --densities 0.01 --hop-overhead-s 0.006   # seconds
    python -m bench.projection --validate --json OUT   # real runs at 25M, 100M, 400M parameters first (root)
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

from bench import _projection_model as model
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
    """Median seconds of ``fn`` with the native codec and torch on one thread (``setup``, untimed, before each
    call)."""
    before, threads = os.environ.get("SYNCD_NUM_THREADS"), torch.get_num_threads()
    os.environ["SYNCD_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        return median_time(fn, repeats, setup=setup, warmup=1)
    finally:
        torch.set_num_threads(threads)
        if before is None:
            os.environ.pop("SYNCD_NUM_THREADS")
        else:
            os.environ["SYNCD_NUM_THREADS"] = before


def host_decode(blobs: list, olds: list):
    """What an engine whose weights are on GPUs does on its host: parse each blob into positions and values
    (``delta.changes``; format 2 from the classes of its base, which a GPU computes and copies over, half a byte
    each: ``delta.base_classes``, computed here untimed)."""
    classes = [delta.base_classes(b, o) for b, o in zip(blobs, olds)]
    return lambda: [delta.changes(b, classes=c) for b, c in zip(blobs, classes)]


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


def monotone(measured: list[dict]) -> list[dict]:
    """``measured`` (rows of :func:`measure_codecs`) with every timing made non-decreasing in density: each
    kind's and format's encode, apply and host-decode seconds become the most of theirs at this or any lower
    density. More changed words never cost less (the codec's work per weight grows with the changes), so a
    lower time at a higher density is the machine's noise -- on a busy machine it projected a 10% update faster
    than a 1% one; the rows returned project the slower, measured side."""
    import copy

    out = copy.deepcopy(sorted(measured, key=lambda r: r["density"]))
    for kind in ("bf16", "nvfp4"):
        for v in ("1", "2"):
            for key in ("encode_s", "apply_s", "host_decode_s"):
                most = 0.0
                for r in out:
                    most = max(most, r[kind][v][key] / r[kind]["weight_bytes"])
                    r[kind][v][key] = most * r[kind]["weight_bytes"]
    return out


def host_rates(sample_mib: float, repeats: int) -> dict:
    """Bytes per second on one core of the checksum, SHA-256 (what the publisher, the daemon and the engine hash
    shards with), a copy (the publisher's snapshot) and the publisher's finite check of bf16 weights, with
    ``finite_mask`` beside it: the same check by a mask of ``~isfinite`` (what the publisher ran before its min/max
    reduction), its baseline."""
    import hashlib

    from syncd.publish.finite import SLICE_ELEMS, check_finite

    def finite_by_mask(tensors):
        for t in tensors.values():
            flat = t.reshape(-1)
            for start in range(0, flat.numel(), SLICE_ELEMS):
                if (~torch.isfinite(flat[start:start + SLICE_ELEMS])).any():
                    raise ValueError("not finite")

    x = torch.randint(0, 256, (int(sample_mib * (1 << 20)),), dtype=torch.uint8)
    y, raw, w = torch.empty_like(x), x.numpy().tobytes(), {"w": torch.zeros(x.numel() // 2, dtype=torch.bfloat16)}
    return {"checksum": x.numel() / one_core(lambda: checksum_many([x]), repeats),
            "sha256": len(raw) / one_core(lambda: hashlib.sha256(raw).digest(), repeats),
            "copy": x.numel() / one_core(lambda: y.copy_(x), repeats),
            "finite": x.numel() / one_core(lambda: check_finite(w), repeats),
            "finite_mask": x.numel() / one_core(lambda: finite_by_mask(w), repeats)}


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


def setup_of(a, kind: str, weight_bytes_per_param: float, hop_s: float) -> model.Setup:
    """The deployment of the assumptions ``a`` for ``kind`` ("bf16" / "nvfp4")."""
    return model.Setup(
        params=a.params, weight_bytes_per_param=weight_bytes_per_param, trainer_hosts=a.trainer_hosts,
        trainer_cores=a.cores_per_host, host_mem_Bps=a.host_mem_gbps * 1e9,
        upload_Bps=model.link_Bps(a.upload_gbit * 1e9), long_Bps=model.link_Bps(a.long_gbit * 1e9),
        intra_Bps=model.link_Bps(a.intra_gbit * 1e9),
        nodes=a.cluster_nodes, fanout=a.fanout, chunk_bytes=a.chunk_mib * 2 ** 20, shard_bytes=a.shard_mib * 2 ** 20,
        tensor_params=a.tensor_params, poll_s=a.poll_s, engine="gpu", node_cores=a.cores_per_host,
        gpus_per_node=a.gpus_per_node,
        gpus_per_engine=a.gpus_per_engine_bf16 if kind == "bf16" else a.gpus_per_engine_nvfp4,
        pcie_Bps=a.pcie_gbps * 1e9, hbm_Bps=a.hbm_gbps * 1e9, staged_bytes_per_change=a.staged_bytes_per_change,
        decode_cores_per_gpu=a.decode_cores_per_gpu, hop_s=hop_s)


def project(row: dict, kind: str, fmt_v: str, a: argparse.Namespace, host: dict, hop_s: float) -> dict:
    """Stage times (seconds) for ``a.params`` parameters of ``kind`` ("bf16" / "nvfp4") in format ``fmt_v`` (with
    format 2, the ``a.sliced_fraction`` of them in format 1): the model fed the one-core rates of ``row`` (a
    :func:`measure_codecs` row) and ``host`` (:func:`host_rates`)."""
    m = row[kind]
    f = rates_of(m, fmt_v, a.sliced_fraction)
    n, wb = row["params"], m["weight_bytes"]
    rates = model.Rates(delta_bytes_per_param=f["bytes"] / n,
                        changed_per_param=row["density_measured"] if kind == "bf16" else m["changed_words_per_param"],
                        encode=wb / f["encode_s"], stage=wb / f["apply_s"], decode=wb / f["host_decode_s"],
                        apply=wb / f["apply_s"], checksum=host["checksum"], sha256=host["sha256"], copy=host["copy"],
                        finite=host["finite"], class_bytes_per_param=f["class_bytes"] / n)
    q = model.stages(setup_of(a, kind, wb / n, hop_s), rates)
    st = q["stages_s"]
    dominant = max(st, key=st.get)
    return {"kind": kind, "format": int(fmt_v), "density": row["density"], "weights_bytes": q["weights_bytes"],
            "delta_bytes": q["delta_bytes"], "delta_pct": 100 * q["delta_bytes"] / q["weights_bytes"],
            "changed": a.params * rates.changed_per_param, "stages_s": st, "total_s": q["total_s"],
            "dominant": dominant, "pause_s": st["pause"], "tree_depth": q["tree_depth"], "shards": q["shards"]}


# ---------------------------------------------------------------------------------------------- main


ASSUMPTIONS = (  # flag, default, meaning
    ("params", 1e12, "parameters of the model"),
    ("trainer-hosts", 128, "trainer hosts publishing in parallel (each its share of the weights)"),
    ("cores-per-host", 32, "cores per host the codec uses (trainer hosts and engine nodes)"),
    ("host-mem-gbps", 200.0, "memory bandwidth of a trainer host in GB/s (caps its encode, copy and finite check)"),
    ("upload-gbit", 25.0, "each trainer host's link to the object store, Gb/s"),
    ("long-gbit", 10.0, "the long link between regions, Gb/s (the remote cluster reads every byte once)"),
    ("intra-gbit", 100.0, "links inside the remote cluster, Gb/s per node"),
    ("cluster-nodes", 64, "nodes of the remote cluster"),
    ("fanout", 2, "broadcast tree fanout"),
    ("gpus-per-node", 8, "GPUs per node (one engine process each)"),
    ("decode-cores-per-gpu", 1.0, "host cores each GPU's engine process decodes its deltas on while it serves (the "
                                  "native decoder would take every core its process may)"),
    ("gpus-per-engine-bf16", 16, "GPUs per engine for bf16 weights (2 TB of HBM for 1T parameters)"),
    ("gpus-per-engine-nvfp4", 8, "GPUs per engine for NVFP4 weights"),
    ("pcie-gbps", 40.0, "host-to-GPU copy rate per GPU, GB/s (PCIe 5 x16, achieved)"),
    ("hbm-gbps", 3500.0, "GPU memory bandwidth, GB/s (H200, achieved)"),
    ("staged-bytes-per-change", 6.0, "bytes per changed word sent to the GPU in the pause (int32 position + word)"),
    ("shard-mib", 64.0, "the publisher's shard size"),
    ("chunk-mib", 1.0, "the cluster's chunk, the unit forwarded down the broadcast tree"),
    ("tensor-params", 16e6, "parameters per tensor (a bigger tensor's delta is a shard of its own)"),
    ("poll-s", 1.0, "the cluster controller's poll interval (a new version waits half of it on average)"),
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
    p.add_argument("--goal-s", type=float, default=30.0)
    p.add_argument("--pause-goal-s", type=float, default=1.0)
    v = p.add_argument_group("validation (--validate: real runs in network namespaces first; needs root)")
    v.add_argument("--validate", action="store_true", help="check the model against real runs, then project")
    v.add_argument("--validate-params", default="25e6,100e6,400e6", help="model sizes run")
    v.add_argument("--validate-densities", default="0.01,0.1", help="changed bf16 words of the deltas run")
    v.add_argument("--validate-repeats", type=int, default=3, help="versions run per size and density")
    v.add_argument("--nodes", type=int, default=4, help="nodes of the simulated cluster (a daemon and an engine each)")
    v.add_argument("--long-mbit", type=float, default=10.0,
                   help="the simulated long link, Mbit/s per 100M parameters (rates scale with the size)")
    v.add_argument("--upload-ratio", type=float, default=2.5, help="the trainer's upload over the long link")
    v.add_argument("--intra-ratio", type=float, default=4.0, help="each node's link over the long link")
    v.add_argument("--chunk-kib", type=int, default=32, help="the simulated cluster's chunk")
    v.add_argument("--cluster-poll-s", type=float, default=0.1, help="the simulated controller's poll interval")
    v.add_argument("--sample-params", type=int, default=1 << 25,
                   help="parameters of the rate samples (at most the size run)")
    v.add_argument("--rate-repeats", type=int, default=5, help="runs of each rate measurement (their median)")
    v.add_argument("--validate-workdir", default=None, help="keep the simulated clusters' files (logs, events) here")
    output_flags(p, "projection")
    return p


def rows(projections: list[dict], params: float, validation: list[dict]) -> list[Row]:
    """The shared columns: per kind, format and density, the projected seconds from publish() to every engine
    serving against the slowest stage alone; per validated size and density, the measured total against the model's
    prediction (ratio: predicted / measured)."""
    out = [Row(f"{q['kind']} format {q['format']} (projected)", q["total_s"],
               q["total_s"] / q["stages_s"][q["dominant"]], f"its slowest stage ({q['dominant']})",
               f"{params:.0e} params {100 * q['density']:.3g}%", "-")
           for q in projections]
    out += [Row(f"validated path, {r['nodes']} nodes", r["measured_s"], r["ratio"], "predicted / measured",
                f"{r['params']:.0e} params {100 * r['density']:.3g}%", "netns")
            for r in validation if r["stage"] == "total"]
    return out


def plot(projections: list[dict], a, path, validation: list[dict]) -> None:
    from bench._plot import pyplot, save

    plt = pyplot()
    fig, axes = plt.subplots(1, 3 if validation else 2, figsize=(18 if validation else 12, 4.5))
    for ax, kind in zip(axes, ("bf16", "nvfp4")):
        ps = [q for q in projections if q["kind"] == kind and q["format"] == 1]
        x = list(range(len(ps)))
        bottom = [0.0] * len(ps)
        for stage in model.STAGES:
            vals = [q["stages_s"][stage] for q in ps]
            ax.bar(x, vals, bottom=bottom, label=stage)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.axhline(a.goal_s, color="red", lw=0.8, ls="--", label=f"goal {a.goal_s:g} s")
        ax.set_xticks(x, [f"{100 * q['density']:.3g}%" for q in ps], rotation=45)
        ax.set(title=f"{a.params:.0e} parameters, {kind}, format 1", xlabel="changed bf16 words",
               ylabel="seconds from publish() to serving")
    axes[0].legend(fontsize=8)
    if validation:
        ax = axes[2]
        for stage in (*model.STAGES, "total"):
            pts = [r for r in validation if r["stage"] == stage]
            ax.loglog([r["measured_s"] for r in pts], [r["predicted_s"] for r in pts], "o", label=stage,
                      ms=7 if stage == "total" else 5)
        lo = min(min(r["measured_s"], r["predicted_s"]) for r in validation)
        hi = max(max(r["measured_s"], r["predicted_s"]) for r in validation)
        xs = [lo, hi]
        ax.plot(xs, xs, "k-", lw=0.8)
        ax.fill_between(xs, [0.8 * x for x in xs], [1.25 * x for x in xs], color="grey", alpha=0.2,
                        label="within 0.8-1.25")
        ax.set(title="validation: real runs in network namespaces", xlabel="measured seconds",
               ylabel="predicted seconds")
        ax.legend(fontsize=7)
    save(fig, path, dpi=120)


def print_table(measured: list[dict], projections: list[dict], sliced: float) -> None:
    stages = model.STAGES
    print(f"\n{'kind':>5} {'fmt':>3} {'density':>7} {'delta':>9} {'enc GB/s/core':>13} " +
          " ".join(f"{s:>9}" for s in stages) + f" {'total':>8}  dominant")
    for r, q in zip([r for r in measured for _ in range(4)], projections):
        m = rates_of(r[q["kind"]], str(q["format"]), sliced)
        print(f"{q['kind']:>5} {q['format']:>3} {100 * q['density']:6.2f}% {q['delta_bytes'] / 1e9:7.2f}GB "
              f"{r[q['kind']]['weight_bytes'] / m['encode_s'] / 1e9:13.2f} " +
              " ".join(f"{q['stages_s'][s]:8.2f}s" for s in stages) + f" {q['total_s']:7.1f}s  {q['dominant']}")


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    if not 0.0 <= a.sliced_fraction <= 1.0:
        print(f"bench.projection: --sliced-fraction must be in [0, 1], got {a.sliced_fraction}", file=sys.stderr)
        return 2
    hop = {"per_hop_s": a.hop_overhead_s, "assumed": True} if a.hop_overhead_s is not None else hop_overhead(a.repeats)
    val = None
    if a.validate:
        from bench import _projection_validate as pv

        val = pv.run(a, hop["per_hop_s"])
        if val is None:
            return 2
    validation = val["validation"] if val else []
    densities = [float(x) for x in a.densities.split(",")]
    t0 = Stopwatch()
    measured = measure_codecs(densities, a.sample_mib, a.repeats)
    host = host_rates(a.sample_mib, a.repeats)
    assumptions = {flag: getattr(a, flag.replace("-", "_")) for flag, _, _ in ASSUMPTIONS}
    print(f"syncd projection: measured here in {t0.elapsed:.0f}s (one core each): checksum "
          f"{host['checksum'] / 1e9:.2f} GB/s, SHA-256 {host['sha256'] / 1e9:.2f} GB/s, finite check "
          f"{host['finite'] / 1e9:.2f} GB/s ({host['finite'] / host['finite_mask']:.1f}x an isfinite mask); "
          f"broadcast hop {1e3 * hop['per_hop_s']:.1f} ms"
          f"{' (assumed)' if hop.get('assumed') else ' (bench.broadcast, loopback, N=2 vs 4)'}")
    print("assumptions: " + ", ".join(f"{k} {v:g}" for k, v in assumptions.items()))
    used = monotone(measured)
    projections = [project(r, kind, v, a, host, hop["per_hop_s"]) for r in used for kind in ("bf16", "nvfp4")
                   for v in ("1", "2")]
    print_table(used, projections, a.sliced_fraction)
    goal = min((q for q in projections if q["kind"] == "bf16" and q["format"] == 1),
               key=lambda q: abs(q["density"] - 0.01))
    v2 = next(q for q in projections if q["kind"] == "bf16" and q["format"] == 2 and q["density"] == goal["density"])
    ok = goal["total_s"] <= a.goal_s and goal["pause_s"] <= a.pause_goal_s
    acc = val["accuracy"] if val else None
    print(f"\nprojection_1t_s ({a.params:.0e} bf16 at {100 * goal['density']:.2g}% over {a.long_gbit:g} Gb/s, "
          f"format 1, the publisher's default): {goal['total_s']:.1f}s (goal {a.goal_s:g}s), pause "
          f"{goal['pause_s']:.3f}s per engine (goal {a.pause_goal_s:g}s): {'met' if ok else 'NOT met'}; dominant "
          f"stage: {goal['dominant']} ({goal['stages_s'][goal['dominant']]:.1f}s); format 2: {v2['total_s']:.1f}s "
          f"({v2['dominant']} {v2['stages_s'][v2['dominant']]:.1f}s)")
    print("validation error: " + ("not validated in this run (--validate)" if acc is None else
          f"totals predicted/measured {acc['total_ratio_range'][0]:.2f}-{acc['total_ratio_range'][1]:.2f}, stages "
          f"{acc['stage_ratio_range'][0]:.2f}-{acc['stage_ratio_range'][1]:.2f}, "
          f"{100 * acc['within_0.8_1.25']:.0f}% within 0.8-1.25; rows whose repeats agree within 1.25: "
          f"{acc['repeatable_rows']} of {len(validation)}"
          + ("" if acc["repeatable_rows"] == 0 else
             f", {100 * acc['repeatable_within_0.8_1.25']:.0f}% of them within 0.8-1.25")))
    out = {"bench": "projection", "assumptions": assumptions, "host_rates": host, "broadcast": hop,
           "measured": measured, "projected_from": used, "projections": projections, "goal": {"case": goal, "met": ok},
           "projection_1t_s": goal["total_s"], "projection_1t": {"case": goal, "format_2": v2,
                                                                 "assumptions": assumptions, "validation_error": acc},
           "validation": validation, "validation_runs": val["runs"] if val else []}
    return finish("projection", args=a, out=out, rows=rows(projections, a.params, validation),
                  draw=lambda path: plot(projections, a, path, validation))


if __name__ == "__main__":
    sys.exit(main())
