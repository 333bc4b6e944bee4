"""The end-of-run picture of a thin-trainer run (matplotlib, Agg backend): reward over steps, the trainer/engine
mismatch over steps (the share of tokens whose IS ratio is outside [0.9, 1.1] on one axis, the KL estimate in nats
on a twin axis), the staleness of the trained tokens in versions, and each engine's weight version against the
trainer's over wall time: one unit per axis. Needs matplotlib
(the ``bench`` and ``test`` extras); :func:`plot_run` raises ImportError naming it otherwise."""

from __future__ import annotations

from pathlib import Path

from syncd.plotting import pyplot, save_figure

__all__ = ["plot_run"]


def _steps(lines, key):
    pts = [(ln["step"], ln.get(key)) for ln in lines if ln.get("kind") == "step"]
    return [s for s, v in pts if v is not None], [v for s, v in pts if v is not None]


def plot_run(lines: list[dict], path, *, title: str = "syncd thin trainer", runs: dict | None = None) -> Path:
    """Write the PNG of one run's metrics ``lines`` to ``path``; ``runs`` (label -> lines) overlays the reward
    of other runs (a baseline) in the first panel. Returns the path."""
    plt = pyplot("plotting")
    t0 = min((ln["t"] for ln in lines), default=0.0)
    fig, axes = plt.subplots(4, 1, figsize=(8, 13))
    ax = axes[0]
    for label, ls in {"this run": lines, **(runs or {})}.items():
        s, r = _steps(ls, "reward_mean")
        ax.plot(s, r, marker=".", label=label)
    ax.set(xlabel="step", ylabel="reward (group mean)", title=title, ylim=(-0.02, 1.02))
    ax.legend(loc="lower right")
    ax = axes[1]
    s, v = _steps(lines, "is_outside")
    ax.plot(s, v, marker=".", color="C0")
    ax.set(xlabel="step", ylim=(-0.02, 1.02), title="trainer vs engine")
    ax.set_ylabel("share of tokens, IS ratio outside [0.9, 1.1]", color="C0", fontsize=8)
    kl = ax.twinx()
    s, v = _steps(lines, "kl_k3")
    kl.plot(s, v, marker=".", color="C1")
    kl.set_yscale("symlog", linthresh=1e-6)
    kl.set_ylabel("KL(mu || pi), k3 estimate (nats)", color="C1", fontsize=8)
    ax = axes[2]
    s, v = _steps(lines, "staleness_mean")
    ax.plot(s, v, marker=".", color="C2")
    ax.set(xlabel="step", ylabel="staleness (versions behind)", title="staleness of the trained tokens")
    ax = axes[3]
    pubs = [ln for ln in lines if ln.get("kind") == "publish"]
    if pubs:
        ax.step([p["t"] - t0 for p in pubs], [p["version"] for p in pubs], where="post", label="trainer (publish)",
                linewidth=2)
    engines = sorted({ln["engine"] for ln in lines if ln.get("kind") == "engine"})
    for name in engines:
        ev = [ln for ln in lines if ln.get("kind") == "engine" and ln["engine"] == name]
        ax.step([e["t"] - t0 for e in ev], [e["version"] for e in ev], where="post", label=f"engine {name}",
                linestyle="--")
    ax.set(xlabel="wall time (s)", ylabel="weight version", title="versions over time")
    ax.legend(loc="upper left", fontsize=8)
    return save_figure(fig, path, dpi=90)
