"""Guards of the headline figures: each headline paired ratio recomputed at a small size against its committed value.

``python -m bench.guards`` measures the quick figures (``bench/_guards.py``: format 2 against format 1, the in-place
apply against a full reload, the replay op against the naive masked softmax, one transfer against the tree broadcast)
and exits 1 when one falls below its fraction of the value committed in ``docs/results/guards.json`` (the test suite
runs the same check: ``tests/bench/test_guards.py``). Absolute times are never compared.

``--refresh`` rewrites ``docs/results/``: it runs the four headline benchmarks at their headline sizes, one at a time
(``HEADLINE``: the commands), keeps their JSON without the per-round arrays (``docs/results/NAME.json``, with the
machine's load before and after), then measures every quick figure ``--runs`` times and commits their median with
the fraction derived from the spread (``_guards.fraction_from_spread``). ``--quick-only`` keeps the headline files.

    python -m bench.guards                       # check (about a minute on two busy cores)
    python -m bench.guards --groups codec,replay # some of them
    python -m bench.guards --refresh             # rerun the headline benchmarks and the quick figures (tens of minutes)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import _guards as g
from bench._report import Row, finish, output_flags

#: the headline benchmarks and their commands (``python -m bench.NAME ARGS``), what ``--refresh`` runs
HEADLINE = {
    "codec": ["--lrs", "1e-6,1e-5", "--ks", "1,8", "--repeats", "5"],
    "engine_update": [],
    "replay": ["--models="],
    "broadcast": ["--nodes", "2,4,8", "--size-mib", "8", "--repeats", "2"],
}
#: per-round or per-item arrays left out of the committed headline JSON (their medians stay)
BULKY = {"all", "single_tcp_all", "updates", "reload_s", "load_full_s", "quiet_apply_s", "failures", "table"}
MAX_LIST = 16


def load() -> str:
    """This machine's load averages and cores, as ``uptime`` says them."""
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f} on {os.cpu_count()} cores"


def slim(obj):
    """``obj`` without the :data:`BULKY` keys and with lists longer than :data:`MAX_LIST` replaced by their length."""
    if isinstance(obj, dict):
        return {k: slim(v) for k, v in obj.items() if k not in BULKY}
    if isinstance(obj, list):
        return {"stripped_items": len(obj)} if len(obj) > MAX_LIST else [slim(v) for v in obj]
    return obj


def headline_values(results: Path = g.RESULTS) -> dict:
    """Figure -> (value, where) from the committed headline JSON (None where the file or the field is missing)."""
    def read(name):
        p = results / f"{name}.json"
        return json.loads(p.read_text()) if p.exists() else None
    out = {k: None for k in g.FIGURES}
    if (c := read("codec")) is not None:
        case = min(c["results"], key=lambda r: r["density"])
        at = f"{case['params'] / 1e6:.0f}M bf16, lr {case['lr']:g} K={case['k']}, {100 * case['density']:.2f}% changed"
        out["codec_encode_v2_vs_v1"] = (case["formats"]["2"]["encode_vs_v1"], at)
        out["codec_apply_v2_vs_v1"] = (case["formats"]["2"]["apply_vs_v1"], at)
    if (e := read("engine_update")) is not None:
        r = e["result"]
        out["engine_reload_vs_apply"] = (r["ratio_reload_to_quiet_apply"], f"{r['params'] / 1e6:.0f}M params, "
                                         f"{100 * r['density']:.2f}% changed, no serving load")
    if (rp := read("replay")) is not None:
        o = rp["op"][0]
        if "speedup" in o["op"].get("cpu", {}):
            out["replay_naive_vs_op"] = (o["op"]["cpu"]["speedup"], f"T={o['rows']} V={o['vocab']}")
    if (b := read("broadcast")) is not None and "shaped" in b["modes"]:
        m = b["modes"]["shaped"]
        row = m["rows"][0]
        out["broadcast_single_vs_tree"] = (1 / row["ratio_single"], f"N={row['nodes']} S={m['S_bytes'] / 2**20:.1f} "
                                           f"MiB, links {b['args']['rate_mbit']:g} Mbit/s")
    return out


def run_headline(name: str, results: Path) -> None:
    """``python -m bench.NAME HEADLINE[NAME]``, its JSON slimmed into ``results/NAME.json`` with the load."""
    with tempfile.TemporaryDirectory(prefix="syncd-guards-") as tmp:
        raw = Path(tmp) / f"{name}.json"
        cmd = [sys.executable, "-m", f"bench.{name}", *HEADLINE[name], "--json", str(raw)]
        before, t0 = load(), time.time()
        print(f"== {' '.join(cmd[1:-2])} ({before})", flush=True)
        subprocess.run(cmd, check=True)
        write_headline(name, json.loads(raw.read_text()), before, load(), time.time() - t0, results)


def write_headline(name: str, data: dict, before: str, after: str, wall_s: float, results: Path = g.RESULTS) -> Path:
    """Write the slimmed headline JSON of ``name`` with how it was made."""
    doc = {"command": f"python -m bench.{name} {' '.join(HEADLINE[name])}".strip(), "load_before": before,
           "load_after": after, "wall_s": round(wall_s, 1), "written": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
           "machine": f"{platform.machine()}, {os.cpu_count()} cores, shared", **slim(data)}
    results.mkdir(parents=True, exist_ok=True)
    path = results / f"{name}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def refresh_quick(runs: int, groups: list[str], path: Path = g.GUARDS_JSON) -> dict:
    """Measure every quick figure of ``groups`` ``runs`` times; commit the medians, the fractions from the spread,
    the runs and the load, next to the headline values (``path``; other figures already there are kept)."""
    old = json.loads(path.read_text())["figures"] if path.exists() else {}
    measured: dict = {}
    sizes: dict = {}
    before = load()
    loads = {}
    for group in groups:
        loads[group] = load()
        for i in range(runs):
            got = g.measure(group)
            if "_skipped" in got:
                print(f"{group}: {got['_skipped']}")
                break
            sizes[group] = got.pop("_size")
            for k, (median, _) in got.items():
                measured.setdefault(k, []).append(median)
            print(f"{group} run {i + 1}/{runs}: " + ", ".join(f"{k} {v[-1]:.3g}" for k, v in measured.items()
                                                            if g.OF_GROUP[k] == group), flush=True)
    heads = headline_values(path.parent)
    figures = dict(old)
    for k, vals in measured.items():
        head = heads[k]
        figures[k] = {"what": g.FIGURES[k], "size": sizes[g.OF_GROUP[k]], "committed": statistics.median(vals),
                      "fraction": g.fraction_from_spread(vals), "runs": vals,
                      "worst_over_median": min(vals) / statistics.median(vals), "load": loads[g.OF_GROUP[k]],
                      "headline": None if head is None else {"value": head[0], "at": head[1]}}
    doc = {"about": "committed values of the quick figures (bench/_guards.py); the guard fails below fraction x "
                    "committed; refresh: python -m bench.guards --refresh",
           "rule": "committed = median of the runs; fraction = min(0.8, 0.8 x worst run / median, rounded down to "
                   "0.05)",
           "written": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()), "load_before": before, "load_after": load(),
           "runs_per_figure": runs, "figures": figures}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def write_gpu_results(folder: Path, path: Path = g.RESULTS / "gpu_check.json") -> Path:
    """``bench/gpu_check.sh``'s results on a GPU, for the docs to cite: every JSON of ``folder`` slimmed, with the
    GPU (``$GPU``: nvidia-smi's line), the date and the test list's exit status (``$RC``)."""
    doc = {"command": "bash bench/gpu_check.sh", "gpu": os.environ.get("GPU", ""),
           "exit_status": int(os.environ.get("RC", -1)),
           "written": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
           "results": {p.name: slim(json.loads(p.read_text())) for p in sorted(Path(folder).glob("*.json"))}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"GPU results written to {path}")
    return path


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.guards", description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", default=",".join(g.GROUPS), help=f"measurements to run, of {', '.join(g.GROUPS)}")
    p.add_argument("--refresh", action="store_true", help="rerun the headline benchmarks and the quick figures and "
                                                          "rewrite docs/results/")
    p.add_argument("--quick-only", action="store_true", help="--refresh: only the quick figures (guards.json)")
    p.add_argument("--runs", type=int, default=5, help="--refresh: quick runs per figure (the spread)")
    p.add_argument("--gpu-results", metavar="DIR", help="write DIR's JSON to docs/results/gpu_check.json and exit "
                                                        "(bench/gpu_check.sh on a GPU)")
    output_flags(p, "guards")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    groups = [x for x in args.groups.split(",") if x]
    if unknown := [x for x in groups if x not in g.GROUPS]:
        print(f"bench.guards: unknown groups {unknown} (choose from {', '.join(g.GROUPS)})", file=sys.stderr)
        return 2
    if args.gpu_results:
        write_gpu_results(Path(args.gpu_results))
        return 0
    if args.refresh:
        if not args.quick_only:
            for name in HEADLINE:
                run_headline(name, g.RESULTS)
        doc = refresh_quick(args.runs, groups)
        print(json.dumps({k: {"committed": v["committed"], "fraction": v["fraction"]}
                          for k, v in doc["figures"].items()}, indent=1))
        return 0
    committed = g.load_committed()
    rows, out, failures = [], {"bench": "guards", "load": load(), "figures": {}}, []
    for group in groups:
        got, failed = g.guard(group, committed)
        failures += failed
        if "_skipped" in got:
            print(f"{group}: skipped ({got['_skipped']})")
            continue
        for k, v in got.items():
            if k.startswith("_"):
                continue
            c = committed[k]
            ok = not any(m.startswith(k + " ") for m in failed)
            out["figures"][k] = {"measured": v, "committed": c["committed"], "fraction": c["fraction"], "ok": ok}
            rows.append(Row(k, None, v, f"floor {c['fraction']:g} x {c['committed']:.3g}x", got.get("_size", ""),
                            refcheck=ok))
    for m in failures:
        print(f"GUARD FAILED: {m}", file=sys.stderr)
    return finish("guards", args, out, rows)


if __name__ == "__main__":
    sys.exit(main())
