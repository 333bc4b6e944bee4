"""Peer replicas of the per-step checkpoints: every owner's newest checkpoint copied to ``k`` peers on other
nodes, verified by hash on arrival and again on the way back, so that a replaced or restarted rank rebuilds its
state from its peers (seconds) instead of the object store.

**Placement** (:func:`place_replicas`): owners are grouped by node; owner ``i`` on node ``n`` sends its replicas to
one owner on each of the ``k`` nodes that follow ``n`` in a ring of the distinct nodes (the owner with the same
index on that node, modulo its size). The ``k`` holders are on ``k`` distinct nodes, none of them ``n``: one node's
death never takes a checkpoint together with all its replicas (``k >= 1``), and every owner holds about ``k``
replicas. ``k`` larger than the number of other nodes is a configuration error.

**Transport**: every owner runs a :class:`syncd.trainer.ft.replica_server.ReplicaServer` (stdlib
``ThreadingHTTPServer``, bound where ``host`` says; loopback by default); this module holds the clients. Every request must carry the job's token
(:mod:`syncd.trainer.ft.replica_wire`; 401 otherwise, counted in ``refused``, the body never read), and every
connection has a deadline on both sides (:func:`~syncd.trainer.ft.replica_wire.transfer_deadline`): a peer that
trickles or stalls is cut off, and nothing is locked while bytes move, so one slow peer never holds up another's
transfer. A replica moves as one framed :mod:`syncd.trainer.ft.ckpt_format` bundle: the manifest (each file's size
and SHA-256, the run id, HMAC-signed with the run's key when one is set), then the raw file bytes.
``PUT /v1/replicas/<owner>/<step>`` stores one (:func:`push_replica`): the holder checks the manifest (owner,
step, run), streams the files into a temporary folder while hashing them, and renames the folder into place only if
every hash matched; it keeps the newest ``keep`` steps per owner. A holder killed mid-transfer leaves a temporary
folder, removed when its server starts again. ``GET /v1/replicas/<owner>`` lists the steps held,
``GET /v1/replicas/<owner>/<step>`` sends one back, checked again by :func:`fetch_replica` /
:func:`fetch_checkpoint` -- against the manifest digest its owner recorded, when the caller has it, before a byte
of it is believed -- before it lands in the owner's own checkpoint folder. ``GET /v1/heal/<step>`` serves the
state staged by :class:`syncd.trainer.ft.heal.VerifiedTransport`. The server's ``close`` lets the transfers in
progress finish (each within its deadline) before it closes.
Why not torchft's own checkpoint transports: both unpickle what they receive (``torch.load(weights_only=False)``,
``pickle.loads`` of the metadata), HTTPTransport serves live tensors by reference, and PGTransport needs the peer
in lockstep on the training process group with fixed tags; the same bundle format is used for their job
(``syncd.trainer.ft.heal``) so only hash-checked safetensors and bounded JSON are ever parsed.

Where the peers are, the replicator that pushes every durable checkpoint, and the rebuild of a lost owner from
its holders are in :mod:`syncd.trainer.ft.peers`.

Thread-safety: the functions are stateless.
"""

from __future__ import annotations

import http.client
import json
from pathlib import Path

from syncd import jsonsafe
from syncd.trainer.ft.ckpt_dir import land_frame, parse_checkpoint
from syncd.trainer.ft.ckpt_format import MANIFEST, StateError, check_owner, frame_prefix, read_frame
from syncd.trainer.ft.replica_wire import MIN_RATE, Deadline, ReplicaError, auth_header, connect, transfer_deadline

__all__ = ["place_replicas", "push_replica", "fetch_replica", "fetch_checkpoint", "list_replicas", "pull_frame",
           "ReplicaError"]

_IO_CHUNK = 8 << 20


def place_replicas(nodes: list[str], k: int) -> list[list[int]]:
    """For each owner ``i`` (on node ``nodes[i]``) the owners that hold its ``k`` replicas (module docstring)."""
    distinct = list(dict.fromkeys(nodes))
    if k < 0:
        raise ValueError(f"the replica count k must be >= 0, got {k}")
    if k > len(distinct) - 1:
        raise ValueError(f"{k} replicas need {k + 1} nodes; the owners are on {len(distinct)} "
                         f"({', '.join(distinct)})")
    on = {n: [i for i, m in enumerate(nodes) if m == n] for n in distinct}
    out = []
    for i, n in enumerate(nodes):
        j, local = distinct.index(n), on[n].index(i)
        out.append([on[distinct[(j + d) % len(distinct)]][local % len(on[distinct[(j + d) % len(distinct)]])]
                    for d in range(1, k + 1)])
    return out


# ---------------------------------------------------------------------------------------------- clients


def _failed(url: str, what: str, exc: BaseException, dl: Deadline) -> ReplicaError:
    if dl.fired:
        return ReplicaError(f"{url}: {what}: not done within its deadline of {dl.seconds:.0f} s (a peer too slow)")
    return ReplicaError(f"{url}: {what}: {type(exc).__name__}: {exc}")


def push_replica(url: str, path, *, owner: str, step: int, token: str | None = None, timeout_s: float = 120.0,
                 min_rate: float = MIN_RATE) -> None:
    """Send the checkpoint folder ``path`` (owner ``owner``, step ``step``) to the replica server at ``url``,
    presenting ``token``, within :func:`~syncd.trainer.ft.replica_wire.transfer_deadline`; ReplicaError if it is
    unreachable, too slow or refuses it (the message carries the holder's reason)."""
    path = Path(path)
    raw = (path / MANIFEST).read_bytes()
    names = sorted(json.loads(raw)["files"])
    total = 8 + len(raw) + sum((path / n).stat().st_size for n in names)
    what = f"replica of {owner} step {step} not sent"
    conn = connect(url, timeout_s)
    try:
        with Deadline(conn.sock, transfer_deadline(total, timeout_s, min_rate)) as dl:
            try:
                conn.putrequest("PUT", f"/v1/replicas/{check_owner(owner)}/{int(step)}")
                for k, v in {"Content-Type": "application/octet-stream", "Content-Length": str(total),
                             **auth_header(token)}.items():
                    conn.putheader(k, v)
                conn.endheaders()
                try:
                    conn.send(frame_prefix(raw) + raw)
                    for n in names:
                        with open(path / n, "rb") as f:
                            while chunk := f.read(_IO_CHUNK):
                                conn.send(chunk)
                except OSError as exc:  # the holder hung up: it may have answered first (a refusal)
                    sent = exc
                else:
                    sent = None
                try:
                    resp = conn.getresponse()
                    body = resp.read(1 << 16)
                except (OSError, http.client.HTTPException) as exc:
                    raise _failed(url, what, sent or exc, dl) from None
            except (OSError, http.client.HTTPException) as exc:
                raise _failed(url, what, exc, dl) from None
        if resp.status != 201:
            raise ReplicaError(f"{url} refused the replica of {owner} step {step}: HTTP {resp.status} "
                               f"{body[:500].decode('utf-8', 'replace')}")
    finally:
        conn.close()


def _get(url: str, path: str, what: str, token: str | None, timeout_s: float, receive, first_s: float | None = None):
    """``receive(response, deadline)`` on ``GET path`` from the server at ``url`` (presenting ``token``; every read
    waiting at most ``timeout_s``, all of it within ``first_s``, default ``timeout_s``, unless ``receive`` resets
    the deadline): its result. A connection that fails, or a StateError once the deadline fired, is a ReplicaError
    naming ``what``."""
    conn = connect(url, timeout_s)
    try:
        with Deadline(conn.sock, timeout_s if first_s is None else first_s) as dl:
            try:
                conn.request("GET", path, headers=auth_header(token))
                return receive(conn.getresponse(), dl)
            except (OSError, http.client.HTTPException) as exc:
                raise _failed(url, what, exc, dl) from None
            except StateError as exc:
                if dl.fired:
                    raise _failed(url, what, exc, dl) from None
                raise
    finally:
        conn.close()


def list_replicas(url: str, owner: str, *, token: str | None = None, timeout_s: float = 10.0) -> list[int]:
    """Steps of ``owner`` the server at ``url`` holds, newest first; ReplicaError when it cannot say."""
    return sorted(_listing(url, owner, token, timeout_s)["steps"], reverse=True)


def held_manifests(url: str, owner: str, *, token: str | None = None, timeout_s: float = 10.0) -> dict[int, str]:
    """``{step: manifest digest}`` of ``owner``'s replicas that the server at ``url`` holds (a step whose digest it
    could not give is left out); ReplicaError when it cannot say."""
    doc = _listing(url, owner, token, timeout_s)
    found = doc.get("manifests")
    if not isinstance(found, dict):
        return {}
    return {int(k): v for k, v in found.items() if k.isdigit() and int(k) in doc["steps"] and isinstance(v, str)}


def _listing(url: str, owner: str, token: str | None, timeout_s: float) -> dict:
    """The replica server's listing of ``owner`` (``steps``: a list of step numbers, checked)."""
    status, raw = _get(url, f"/v1/replicas/{check_owner(owner)}", f"listing replicas of {owner}", token, timeout_s,
                       lambda resp, dl: (resp.status, resp.read(1 << 20)))
    if status != 200:
        raise ReplicaError(f"{url}: HTTP {status} listing replicas of {owner}: {raw[:300].decode('utf-8', 'replace')}")
    doc = jsonsafe.loads(raw, what=f"{url} replica listing", max_bytes=1 << 20, max_depth=3, floats=False,
                         error=ReplicaError)
    steps = doc.get("steps") if isinstance(doc, dict) else None
    if not isinstance(steps, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                              for s in steps):
        raise ReplicaError(f"{url}: malformed replica listing of {owner}")
    return doc


def pull_frame(url: str, path: str, what: str, *, timeout_s: float, min_rate: float, token: str | None, receive,
               first_s: float | None = None):
    """``receive(response, length, where)`` on the framed bundle that ``GET path`` answers from the replica server at
    ``url`` (``what`` it is, for the messages; its headers within ``first_s``, default ``timeout_s``, its body within
    :func:`~syncd.trainer.ft.replica_wire.transfer_deadline`): its result. ReplicaError for a refusal, a reply
    without its length, a failed or too slow connection."""
    where = f"{what} from {url}"

    def body(resp, dl):
        if resp.status != 200:
            raise ReplicaError(f"{url}: HTTP {resp.status} for the {what}: "
                               f"{resp.read(2000).decode('utf-8', 'replace')}")
        length = resp.headers.get("Content-Length")
        if not (length and length.isdigit()):
            raise ReplicaError(f"{where}: no Content-Length")
        dl.reset(transfer_deadline(int(length), timeout_s, min_rate))
        return receive(resp, int(length), where)

    return _get(url, path, what, token, timeout_s, body, first_s)


def _pull(url: str, owner: str, step: int, timeout_s: float, min_rate: float, token: str | None, receive):
    """:func:`pull_frame` of ``GET /v1/replicas/<owner>/<step>``."""
    return pull_frame(url, f"/v1/replicas/{check_owner(owner)}/{int(step)}", f"replica of {owner} step {step}",
                      timeout_s=timeout_s, min_rate=min_rate, token=token, receive=receive)


def fetch_replica(url: str, owner: str, step: int, dest_root, *, signing_key=None, timeout_s: float = 120.0,
                  max_bytes: int = 1 << 40, token: str | None = None, run_id: str | None = None,
                  manifest_sha256: str | None = None, min_rate: float = MIN_RATE) -> Path:
    """Fetch ``owner``'s replica of ``step`` from ``url`` into ``dest_root/step-<step>`` (atomic), every file
    verified against the manifest on the way (the manifest against ``manifest_sha256``, its run against ``run_id``,
    when given); StateError if it does not verify, ReplicaError if unreachable or too slow."""
    return _pull(url, owner, step, timeout_s, min_rate, token, lambda resp, length, where: land_frame(
        resp.read, length, Path(dest_root), owner=owner, step=step, signing_key=signing_key, max_bytes=max_bytes,
        where=where, run_id=run_id, manifest_sha256=manifest_sha256))


def fetch_checkpoint(url: str, owner: str, step: int, *, signing_key=None, timeout_s: float = 120.0,
                     max_bytes: int = 1 << 40, token: str | None = None, run_id: str | None = None,
                     manifest_sha256: str | None = None, min_rate: float = MIN_RATE):
    """``owner``'s replica of ``step`` from ``url``, verified (the manifest against ``manifest_sha256`` and ``run_id``
    when given, then every hash) and parsed in memory, never touching the disk: ``(bundle, checkpoint)``;
    :func:`syncd.trainer.ft.ckpt_dir.write_bundle` persists the bundle. StateError / ReplicaError."""
    def receive(resp, length, where):
        bundle = read_frame(resp.read, length, where=where, signing_key=signing_key, owner=owner, step=step,
                            run_id=run_id, manifest_sha256=manifest_sha256, max_bytes=max_bytes,
                            readinto=resp.readinto)
        return bundle, parse_checkpoint(bundle, where)

    return _pull(url, owner, step, timeout_s, min_rate, token, receive)
