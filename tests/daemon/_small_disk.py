"""Run processes with a small, nearly full disk mounted at one directory: a real ENOSPC, without root.

    unshare -rm python -m tests.daemon._small_disk --mount DIR --size BYTES --free BYTES --release FILE
        [--ready FILE] -- CMD ... [--- CMD ...]

Run inside a new user and mount namespace (``unshare -rm``), it mounts a tmpfs of ``--size`` bytes at
``--mount`` (only the commands here see it), fills it until ``--free`` bytes are left, starts the commands
(they die with this process) -- the second and later ones once ``--ready`` (an engine's ready file) exists,
with ``{url}`` in their arguments replaced by the URL in it -- and deletes the filler once ``--release``
exists (the test "frees space"). It exits when a command exits, or on SIGTERM/SIGINT, killing the others.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--")
    p = argparse.ArgumentParser()
    p.add_argument("--mount", required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--free", type=int, required=True)
    p.add_argument("--release", required=True)
    p.add_argument("--ready", default=None)
    a = p.parse_args(argv[:split])
    commands, cur = [], []
    for arg in argv[split + 1:]:
        if arg == "---":
            commands.append(cur)
            cur = []
        else:
            cur.append(arg)
    commands.append(cur)
    mount = Path(a.mount)
    mount.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={a.size}", "tmpfs", str(mount)], check=True)
    filler = mount / ".filler"
    with open(filler, "wb") as fh:
        try:
            while os.statvfs(mount).f_bavail * os.statvfs(mount).f_frsize > a.free:
                fh.write(b"\0" * 4096)
                fh.flush()
        except OSError:
            pass
    children = [subprocess.Popen(commands[0], preexec_fn=_die_with_parent)]
    if len(commands) > 1:
        import json

        while not (a.ready and os.path.exists(a.ready)) and children[0].poll() is None:
            time.sleep(0.05)
        url = json.loads(Path(a.ready).read_text())["url"]
        children += [subprocess.Popen([x.replace("{url}", url) for x in c], preexec_fn=_die_with_parent)
                     for c in commands[1:]]
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(1))
    try:
        while not stop and all(c.poll() is None for c in children):
            if filler.exists() and os.path.exists(a.release):
                filler.unlink()
            time.sleep(0.05)
    finally:
        for c in children:
            if c.poll() is None:
                c.terminate()
        for c in children:
            try:
                c.wait(20)
            except subprocess.TimeoutExpired:
                c.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
