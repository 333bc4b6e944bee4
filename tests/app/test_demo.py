"""`syncd demo --weights-only` end to end with small settings: real trainer, daemon and engine processes and a
client (the RL demo, plain `syncd demo`, is tests/app/test_rl_demo.py). The kept store is signed with the demo's
Ed25519 key, whose public half the demo writes next to the store and names in the command it prints: `syncd ls` with
it lists every version, verified."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.app.conftest import delta_formats_in

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.integration
@pytest.mark.slow
def test_demo_runs_and_loses_no_request(tmp_path):
    out = tmp_path / "demo.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    p = subprocess.run([sys.executable, "-m", "syncd.app.cli", "demo", "--weights-only", "--versions", "6",
                        "--every-k", "1", "--full-every", "4", "--interval", "0.5", "--clients", "2",
                        "--json", str(out), "--dir", str(tmp_path / "work"), "--plot", str(tmp_path / "t.png")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    s = json.loads(out.read_text())
    for key in ("versions_applied", "requests_served", "requests_lost", "pause_s_median", "pause_s_max",
                "bytes_per_version_median", "full_bytes"):
        assert key in s
    assert s["requests_lost"] == 0 and s["requests_served"] > 0 and s["engines_bit_exact"] is True
    assert s["final_version"] == 5 and s["versions_published"] == 6 and s["versions_applied"] >= 1
    assert 0 < s["bytes_per_version_median"] < s["full_bytes"]
    assert "syncd demo summary" in p.stdout and "[demo]" in p.stdout  # plain progress lines off a terminal
    assert p.stdout.splitlines()[0].startswith("[demo] weight sync on this machine")
    assert 0 < s["delta_fraction_median"] < 1 and f"{s['delta_fraction_median']:.1%} of the" in p.stdout
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and s["timeline_png"] in p.stdout
    assert "None" not in p.stdout and "e+0" not in p.stdout, p.stdout  # numbers people read
    assert str(tmp_path / "work") in p.stdout  # the kept work dir is named
    formats = delta_formats_in(tmp_path / "work" / "store")  # format 2, the matrices' deltas context-coded
    assert s["delta_format"] == 2 and "format 2" in p.stdout and formats.get(-2, 0) > 0 and 1 not in formats, formats
    assert_kept_store_reads(p.stdout, tmp_path / "work", env, versions=6)


def assert_kept_store_reads(stdout: str, work, env, versions: int) -> None:
    """The demo printed a `syncd ls` command for its kept store; run as printed, it lists every version verified
    with the public key in the work dir (and the private key, next to it, is the owner's alone)."""
    import re
    import shlex
    import stat

    command = re.search(r"`(syncd ls [^`]+)`", stdout)
    assert command, stdout[-3000:]
    argv = shlex.split(command.group(1))
    assert argv[argv.index("--verify-key") + 1] == str(work / "signing.pub")
    assert stat.S_IMODE((work / "signing.key").stat().st_mode) == 0o600
    bare = {k: v for k, v in env.items() if not k.startswith("SYNCD_")}
    p = subprocess.run([sys.executable, "-m", "syncd.app.cli", *argv[1:]], env=bare, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0 and p.stdout.count("ok (signed ed25519 key") == versions, p.stdout + p.stderr
