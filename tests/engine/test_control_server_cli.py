"""The standalone engine process's command line: a taken ``--port`` is named at once, before the model loads (a
model folder that does not exist proves nothing was loaded), with exit status 2."""

from __future__ import annotations

import socket
import subprocess
import sys


def test_a_taken_port_is_named_before_the_model_loads(tmp_path):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        p = subprocess.run([sys.executable, "-m", "syncd.engine.control_server", "--model", str(tmp_path / "absent"),
                            "--port", str(port), "--engine-token-file", str(tmp_path / "token")],
                           capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr[-2000:]
    assert f"--port {port} on 127.0.0.1 cannot be used" in p.stderr and "Traceback" not in p.stderr
