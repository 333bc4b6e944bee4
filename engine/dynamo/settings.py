"""How a Dynamo process of a node finds the others: discovery backend, request plane, bind addresses.

Dynamo's runtime reads its configuration from ``DYN_*`` / ``ETCD_*`` / ``NATS_*`` environment variables when
a ``DistributedRuntime`` is created. :class:`DynamoSettings` is the one place that turns syncd's flags into
those variables (:meth:`DynamoSettings.environ`), so the launcher, workers, frontend, tests and benchmarks
agree. Two backends:

* ``file`` (default; no servers): discovery through files in ``file_kv`` (one directory shared by every
  process of the node, and only by them: ``syncd serve`` gives each node its own); request and response planes
  over TCP.
* ``etcd``: discovery in etcd (``etcd_endpoints``), requests over NATS (``nats_server``) -- the
  production-style path across nodes.

Every address binds to ``host`` (loopback by default). Flags in the CLIs that use this override the
``SYNCD_DYNAMO_*`` variables listed in :data:`ENV`.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, replace
from pathlib import Path

__all__ = ["DynamoSettings", "add_arguments", "add_frontend_arguments", "env_int", "from_args", "ENV",
           "default_file_kv"]

DISCOVERY_BACKENDS = ("file", "etcd")

#: syncd's own variables (flag -> variable), read as defaults by :func:`add_arguments`
ENV = {
    "discovery": "SYNCD_DYNAMO_DISCOVERY",
    "file_kv": "SYNCD_DYNAMO_FILE_KV",
    "etcd_endpoints": "SYNCD_DYNAMO_ETCD_ENDPOINTS",
    "nats_server": "SYNCD_DYNAMO_NATS_SERVER",
    "host": "SYNCD_DYNAMO_HOST",
    "namespace": "SYNCD_DYNAMO_NAMESPACE",
}


def default_file_kv() -> Path:
    """Where file discovery lives unless told: ``$XDG_RUNTIME_DIR/syncd-dynamo`` or ``/tmp/syncd-dynamo-<uid>``."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base:
        return Path(base, "syncd-dynamo")
    return Path("/tmp", f"syncd-dynamo-{os.getuid()}")


@dataclass(frozen=True)
class DynamoSettings:
    """Discovery and transport settings of one node's Dynamo processes (see the module docstring).

    ``namespace``: the Dynamo namespace workers register in and the frontend watches. ``log``: ``DYN_LOG``
    (Dynamo's own log filter) unless the environment already sets it."""

    discovery: str = "file"
    file_kv: Path | None = None
    etcd_endpoints: str | None = None
    nats_server: str | None = None
    host: str = "127.0.0.1"
    namespace: str = "syncd"
    log: str = "warn"

    def __post_init__(self):
        if self.discovery not in DISCOVERY_BACKENDS:
            raise ValueError(f"discovery backend must be one of {', '.join(DISCOVERY_BACKENDS)}, "
                             f"got {self.discovery!r}")
        if self.discovery == "etcd" and not (self.etcd_endpoints and self.nats_server):
            raise ValueError("the etcd backend needs etcd endpoints (--etcd-endpoints) and a NATS server "
                             "(--nats-server)")
        if not self.namespace or not self.namespace.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"namespace must be letters, digits, '-' or '_', got {self.namespace!r}")

    @property
    def request_plane(self) -> str:
        return "nats" if self.discovery == "etcd" else "tcp"

    def resolved(self) -> "DynamoSettings":
        """With ``file_kv`` filled in for the file backend."""
        if self.discovery == "file" and self.file_kv is None:
            return replace(self, file_kv=default_file_kv())
        return self

    def environ(self, base: dict | None = None) -> dict[str, str]:
        """``base`` (default: this process's environment) plus the variables Dynamo reads."""
        s = self.resolved()
        env = dict(os.environ if base is None else base)
        env["DYN_DISCOVERY_BACKEND"] = s.discovery
        env["DYN_REQUEST_PLANE"] = s.request_plane
        for var in ("DYN_TCP_RPC_HOST", "DYN_TCP_RESPONSE_STREAM_HOST", "DYN_EVENT_PLANE_HOST", "DYN_SYSTEM_HOST"):
            env[var] = s.host
        env.setdefault("DYN_LOG", s.log)
        if s.discovery == "file":
            env["DYN_FILE_KV"] = str(s.file_kv)
            for var in ("ETCD_ENDPOINTS", "NATS_SERVER", "DYN_EVENT_PLANE"):  # a NATS event plane needs NATS
                env.pop(var, None)
        else:
            env.pop("DYN_FILE_KV", None)
            env["ETCD_ENDPOINTS"] = s.etcd_endpoints
            env["NATS_SERVER"] = s.nats_server
            env["DYN_EVENT_PLANE"] = "nats"
        return env

    def apply(self) -> None:
        """Set this process's environment (before creating a ``DistributedRuntime``)."""
        s = self.resolved()
        if s.file_kv is not None:
            Path(s.file_kv).mkdir(parents=True, exist_ok=True)
        env = s.environ()
        for var in [v for v in os.environ if v not in env]:
            del os.environ[var]
        os.environ.update(env)

    def argv(self) -> list[str]:
        """The flags that give a child process these settings."""
        s = self.resolved()
        out = ["--discovery", s.discovery, "--host", s.host, "--namespace", s.namespace]
        if s.file_kv is not None:
            out += ["--file-kv", str(s.file_kv)]
        if s.etcd_endpoints:
            out += ["--etcd-endpoints", s.etcd_endpoints]
        if s.nats_server:
            out += ["--nats-server", s.nats_server]
        return out


def add_arguments(p: argparse.ArgumentParser, *, file_kv_default: str | None = None) -> None:
    """Add the discovery/transport flags (defaults from the ``SYNCD_DYNAMO_*`` variables). ``file_kv_default``:
    what the command uses without ``--file-kv`` (shown in the help; default :func:`default_file_kv`)."""
    g = p.add_argument_group("Dynamo discovery and transport")
    g.add_argument("--discovery", choices=DISCOVERY_BACKENDS, default=os.environ.get(ENV["discovery"], "file"),
                   help="discovery backend: file (no servers, one node) or etcd (+ NATS) [SYNCD_DYNAMO_DISCOVERY]")
    g.add_argument("--file-kv", default=os.environ.get(ENV["file_kv"]),
                   help="directory of file discovery; processes that share it share a pool of workers "
                        f"[SYNCD_DYNAMO_FILE_KV; default {file_kv_default or default_file_kv()}]")
    g.add_argument("--etcd-endpoints", default=os.environ.get(ENV["etcd_endpoints"]),
                   help="etcd client URLs, comma-separated (etcd backend) [SYNCD_DYNAMO_ETCD_ENDPOINTS]")
    g.add_argument("--nats-server", default=os.environ.get(ENV["nats_server"]),
                   help="NATS server URL, nats://host:port (etcd backend) [SYNCD_DYNAMO_NATS_SERVER]")
    g.add_argument("--host", default=os.environ.get(ENV["host"], "127.0.0.1"),
                   help="address Dynamo's TCP planes and system server bind to [SYNCD_DYNAMO_HOST]")
    g.add_argument("--namespace", default=os.environ.get(ENV["namespace"], "syncd"),
                   help="Dynamo namespace of the workers and the frontend [SYNCD_DYNAMO_NAMESPACE]")


def env_int(var: str):
    """An argparse ``type`` for an integer flag whose default comes from ``var``: a bad value (on the command line
    or in ``var``) is refused naming both, e.g. ``argument --http-port: 'abc' is not an integer (the flag, or
    SYNCD_DYNAMO_HTTP_PORT)``. Give the default as the variable's string: argparse converts it only when the flag
    is absent, so ``--help`` works whatever the variable holds."""

    def parse(text: str) -> int:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer (the flag, or {var})") from None

    parse.__name__ = "int"
    return parse


def add_frontend_arguments(p, *, migration_default: str = "3") -> None:
    """The OpenAI frontend's address flags (``SYNCD_DYNAMO_HTTP_HOST``/``_PORT``) and its migration limit
    (``DYN_MIGRATION_LIMIT``), one definition for ``syncd.engine.dynamo.frontend`` and ``syncd serve``."""
    env = os.environ.get
    p.add_argument("--http-host", default=env("SYNCD_DYNAMO_HTTP_HOST", "127.0.0.1"),
                   help="frontend address [SYNCD_DYNAMO_HTTP_HOST]")
    p.add_argument("--http-port", type=env_int("SYNCD_DYNAMO_HTTP_PORT"), default=env("SYNCD_DYNAMO_HTTP_PORT", "8000"),
                   help="frontend port, 0: a free one [SYNCD_DYNAMO_HTTP_PORT]")
    p.add_argument("--migration-limit", type=env_int("DYN_MIGRATION_LIMIT"),
                   default=env("DYN_MIGRATION_LIMIT", migration_default),
                   help="times a request may move to another worker when its worker dies, 0: never "
                        "[DYN_MIGRATION_LIMIT]")


def from_args(args: argparse.Namespace) -> DynamoSettings:
    """Settings from parsed :func:`add_arguments` flags (raises ValueError for a bad combination)."""
    return DynamoSettings(discovery=args.discovery, file_kv=Path(args.file_kv) if args.file_kv else None,
                          etcd_endpoints=args.etcd_endpoints, nats_server=args.nats_server, host=args.host,
                          namespace=args.namespace)
