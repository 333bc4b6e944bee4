"""``bench.vllm_idle`` on a real vLLM (CPU): an idle engine called every 0.5 s keeps a core busy (vLLM's worker
busy-polls for 1 s after each call), and costs almost nothing without calls; the JSON holds every row."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from bench import vllm_idle

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def test_an_idle_vllm_called_every_half_second_spins_and_one_not_called_does_not(tmp_path):
    if os.environ.get("SYNCD_VLLM") == "off":
        pytest.skip("SYNCD_VLLM=off: the vllm extra is not installed on this machine")
    out = tmp_path / "vllm_idle.json"
    assert vllm_idle.main(["--periods", "0.5", "--window", "3", "--settle", "1.5", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    [idle, called] = data["rows"]
    assert idle["period_s"] is None and idle["spin_limit"] is None
    assert called["period_s"] == 0.5 and called["spin_limit"] == 1.0
    # the spin is CPU time whatever the machine's load (a starved spinner still gets its share of the cores)
    assert called["cores"] > max(0.1, 3 * idle["cores"]), data["rows"]
    assert [r["backend"] for r in data["table"]] == ["idle, no calls", "a call every 0.5 s"]


def test_the_process_tree_cpu_counts_a_child():
    """A child that burns 0.5 s of CPU shows in its parent's tree (beyond what the parent used itself)."""
    tree, own = vllm_idle.process_tree_cpu_s(os.getpid()), time.process_time()
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                              "while time.process_time() - t < 0.5: pass\ninput()"], stdin=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while vllm_idle.process_tree_cpu_s(os.getpid()) - tree - (time.process_time() - own) < 0.45:
            assert time.monotonic() < deadline, "the child's CPU time never showed"
            time.sleep(0.05)
    finally:
        child.communicate(b"\n", timeout=60)
