"""What re-hashing node-cache shards on every read costs (issue 14: "a cache that heals").

Every shard an engine reads from the node cache is SHA-256-checked against its manifest as it is read
(``syncd.engines.Update.from_cache(verify_shards=True)``, ``syncd.cache.read_shards``), so bytes that rotted
or were altered after the
daemon verified them are refused, and the daemon re-fetches them. This benchmark measures that choice:

1. *Throughput*, over real files in a cache directory (warm page cache, what a just-downloaded shard is):
   the read pass alone (open + ``readinto``, what the engine does anyway), the read pass plus SHA-256 on one
   thread, and ``read_shards``' parallel read+hash over all shards -- GB/s each, and the ratios to the
   read pass as medians of per-round ratios (the three take turns in every round, so a noisy neighbour
   moves numerator and denominator together). The physical limit is the read pass itself.
2. *What it adds to an update*: a real delta (AdamW steps at an RL learning rate on a small Qwen2,
   ``bench.codec.snapshots``) published by ``syncd.trainer.WeightPublisher`` to a file store, its shards in a node
   cache; an engine (``syncd.engine.StateDictEngine``) stages and applies it with the shards verified and not,
   in turns; the median added seconds and the share of the stage+apply time.

    python -m bench.cache_verify                  # 512 MiB of shards; a ~30M-parameter model's delta
    python -m bench.cache_verify --preset tiny    # seconds; what the test runs

Writes JSON (``--json``, ``SYNCD_BENCH_OUT``); ``--plot PNG`` draws the throughputs (matplotlib).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

from bench._report import Row, finish, output_flags
from bench._timing import Stopwatch

PRESETS = {
    "default": dict(total_mib=512, shard_mib=64, rounds=5, hidden=512, layers=8, heads=8, kv_heads=4,
                    intermediate=1536, vocab=16000, batch=2, seq=64, warmup=3, lr=1e-5, update_rounds=5),
    "tiny": dict(total_mib=16, shard_mib=4, rounds=2, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128,
                 vocab=512, batch=2, seq=16, warmup=1, lr=1e-5, update_rounds=2),
}


def _read(path: Path) -> bytearray:
    with open(path, "rb") as fh:
        data = bytearray(os.fstat(fh.fileno()).st_size)
        fh.readinto(data)
    return data


def throughput(cfg: dict, root: Path) -> dict:
    """Read pass vs read+SHA-256 vs read_shards' parallel verified read over the same files."""
    from syncd import manifest as mf
    from syncd.cache import read_shard, shard_path

    n, size = cfg["total_mib"] // cfg["shard_mib"], cfg["shard_mib"] << 20
    entries = []
    for i in range(n):
        data = os.urandom(size)
        sha = hashlib.sha256(data).hexdigest()
        path = shard_path(root, sha)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        entries.append(mf.ShardEntry(f"versions/000000000000/shards/{'0' * 16}-{i:05d}.safetensors", size, sha,
                                     "safetensors"))
    total = n * size

    def read_pass():
        for s in entries:
            _read(shard_path(root, s.sha256))

    def read_hash():
        for s in entries:
            hashlib.sha256(_read(shard_path(root, s.sha256))).hexdigest()

    def parallel_verified():
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(4) as pool:  # what read_shards does (threads=4)
            list(pool.map(lambda s: read_shard(root, s, 0), entries))

    read_pass()  # warm the page cache
    runs = {"read": [], "read_sha256": [], "parallel_verified": []}
    for _ in range(cfg["rounds"]):
        for name, fn in (("read", read_pass), ("read_sha256", read_hash), ("parallel_verified", parallel_verified)):
            t0 = Stopwatch()
            fn()
            runs[name].append(t0.elapsed)
    out = {name: total / statistics.median(ts) / 1e9 for name, ts in runs.items()}
    ratio = lambda name: statistics.median(r / h for r, h in zip(runs["read"], runs[name]))  # noqa: E731
    return {"bytes": total, "shards": n, "gbps": out,
            "vs_read": {"read_sha256": ratio("read_sha256"), "parallel_verified": ratio("parallel_verified")}}


def update_cost(cfg: dict, work: Path) -> dict:
    """Stage + apply of a real delta from the node cache, shards verified vs not, in turns."""
    import torch

    from syncd import engine
    from bench.codec import snapshots
    from syncd.cache import ShardCache
    from syncd.engines.update import Update
    from syncd.store import Store
    from syncd.versions import fetch_shards, read_manifest
    from syncd.publish.publisher import WeightPublisher

    old, new = snapshots(cfg, cfg["lr"], 1, seed=0)
    store = Store(work / "store")
    with WeightPublisher(store, "bench", signing_key=False, full_every=10**6, shard_bytes=16 << 20) as pub:
        pub.publish(old, 0)
        pub.publish(new, 1)
    cache = ShardCache(work / "cache")
    m1 = read_manifest(store, "bench", 1, signing_key=False)
    for s, data in zip(m1.shards, fetch_shards(store, "bench", m1)):
        cache.put(s.sha256, data)
    times = {True: [], False: []}
    for r in range(cfg["update_rounds"] + 1):  # the first round warms up, untimed
        for verify in (False, True):
            eng = engine.StateDictEngine({k: v.clone() for k, v in old.items()}, 0)
            t0 = Stopwatch()
            eng.stage(Update.from_cache(m1, cache.root, verify_shards=verify).load())
            eng.pause()
            eng.apply()
            eng.resume()
            if r:
                times[verify].append(t0.elapsed)
            assert all(torch.equal(eng.state_dict()[k], new[k]) for k in new)
    plain, verified = statistics.median(times[False]), statistics.median(times[True])
    return {"delta_bytes": m1.total_bytes, "full_bytes": sum(t.nbytes for t in m1.tensors),
            "params": sum(t.numel for t in m1.tensors), "stage_apply_s": plain, "stage_apply_verified_s": verified,
            "added_s": verified - plain, "added_pct": 100 * (verified - plain) / plain}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.cache_verify", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="default")
    p.add_argument("--rounds", type=int, help="timing rounds (medians are reported)")
    output_flags(p, "cache_verify")
    return p


def rows(tp: dict, up: dict) -> list[Row]:
    """The shared columns: reading and hashing against the read pass of the same files, and an update from the
    cache with its shards verified against the same update unverified."""
    sizes = f"{tp['shards']} shards {tp['bytes'] / 2**20:.0f} MiB"
    secs = lambda name: tp["bytes"] / (tp["gbps"][name] * 1e9)  # noqa: E731
    return [Row("read + SHA-256, one thread", secs("read_sha256"), tp["vs_read"]["read_sha256"], "read pass", sizes),
            Row("read_shards verified, 4 threads", secs("parallel_verified"), tp["vs_read"]["parallel_verified"],
                "read pass", sizes),
            Row("stage+apply, shards verified", up["stage_apply_verified_s"],
                up["stage_apply_s"] / up["stage_apply_verified_s"], "stage+apply, unverified",
                f"{up['params'] / 1e6:.1f}M params delta")]


def plot(tp: dict, path) -> None:
    """The three throughputs as bars (GB/s, warm page cache)."""
    from bench._plot import pyplot, save

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3))
    names = ["read", "read_sha256", "parallel_verified"]
    ax.barh(["read pass", "read + SHA-256", "verified (4 threads)"], [tp["gbps"][n] for n in names])
    ax.set_xlabel("GB/s (warm page cache)")
    ax.set_title("node cache: re-hash on read")
    save(fig, path, dpi=120)


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    cfg = dict(PRESETS[args.preset])
    if args.rounds:
        cfg["rounds"] = cfg["update_rounds"] = args.rounds
    print(f"syncd cache re-hash benchmark: preset {args.preset}, {os.cpu_count()} CPUs, "
          f"{platform.processor() or platform.machine()}")
    with tempfile.TemporaryDirectory(prefix="syncd-cache-verify-") as tmp:
        tp = throughput(cfg, Path(tmp) / "raw")
        up = update_cost(cfg, Path(tmp))
    g, r = tp["gbps"], tp["vs_read"]
    print(f"{tp['shards']} shards, {tp['bytes'] / 2**20:.0f} MiB, warm page cache:")
    print(f"  read pass (the limit)         {g['read']:7.2f} GB/s")
    print(f"  read + SHA-256, one thread    {g['read_sha256']:7.2f} GB/s  ({r['read_sha256']:.2f}x the read pass)")
    print(f"  update_from_cache, verified   {g['parallel_verified']:7.2f} GB/s  ({r['parallel_verified']:.2f}x the "
          "read pass; 4 threads)")
    up["hash_s_expected"] = up["delta_bytes"] / (g["read_sha256"] * 1e9)
    print(f"a delta update of {up['params'] / 1e6:.1f}M parameters ({up['delta_bytes'] / 2**20:.2f} MiB of shards for "
          f"{up['full_bytes'] / 2**20:.1f} MiB of weights): stage+apply {up['stage_apply_s'] * 1e3:.1f} ms, with "
          f"re-hashed shards {up['stage_apply_verified_s'] * 1e3:.1f} ms: {up['added_s'] * 1e3:+.2f} ms "
          f"({up['added_pct']:+.1f}%; the hash alone at the rate above: {up['hash_s_expected'] * 1e3:.2f} ms = "
          f"{100 * up['hash_s_expected'] / up['stage_apply_s']:.1f}% of the update)")
    out = {"bench": "cache_verify", "preset": args.preset, "config": cfg, "cpus": os.cpu_count(),
           "python": sys.version.split()[0], "throughput": tp, "update": up}
    return finish("cache_verify", args, out, rows(tp, up), lambda path: plot(tp, path))


if __name__ == "__main__":
    sys.exit(main())
