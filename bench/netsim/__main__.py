"""``python -m bench.netsim s3serve ROOT [--host H] [--port P] [--bucket B] [--log PATH] [--ready PATH]
[--writable]``: serve a file store directory as an S3 bucket, read-only unless ``--writable``
(:class:`bench.netsim.s3.S3FileServer`). ``python -m bench.netsim watch NAME=URL ... --out FILE [--every-s S]``:
sample engines' versions and checksums until SIGTERM (:mod:`bench.netsim.watch`)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

from bench.netsim.s3 import S3FileServer


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.netsim")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("s3serve", help="serve a file store directory as an S3 bucket")
    s.add_argument("root")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=0)
    s.add_argument("--bucket", default="simstore")
    s.add_argument("--log", default=None, help="append a JSON line per object body sent")
    s.add_argument("--ready", default=None, help="write the bound port here once listening")
    s.add_argument("--writable", action="store_true", help="accept PUT and DELETE (a publisher writes here)")
    w = sub.add_parser("watch", help="sample engines' versions and weight checksums until SIGTERM")
    w.add_argument("engines", nargs="+", metavar="NAME=URL")
    w.add_argument("--out", required=True, help="append a JSON line per engine and round here")
    w.add_argument("--every-s", type=float, default=0.3)
    a = p.parse_args(argv)
    if a.cmd == "watch":
        from bench.netsim import watch

        return watch.main(a)
    srv = S3FileServer(a.root, a.host, a.port, bucket=a.bucket, log_path=a.log, writable=a.writable)
    if a.ready:
        tmp = a.ready + ".tmp"
        Path(tmp).write_text(str(srv.server_address[1]))
        os.replace(tmp, a.ready)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=srv.shutdown).start())
    srv.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
