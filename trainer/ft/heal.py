"""``VerifiedTransport``: torchft's checkpoint transport for live recovery, carrying only verified bytes.

When a replica group joins a quorum behind the others, torchft's Manager has a healthy peer call
``send_checkpoint(dst_ranks, step, state_dict)`` and the joiner ``recv_checkpoint(src_rank, metadata, step)``
(``torchft.checkpointing.CheckpointTransport``). torchft's own transports pickle the state (HTTPTransport
``torch.load(weights_only=False)``, PGTransport ``pickle.loads`` of its metadata): a peer could make the receiver
run code. This one implements the same interface with the :mod:`syncd.trainer.ft.ckpt_format` bundle: the state is
flattened into safetensors bytes plus a JSON skeleton, framed behind a manifest with every file's SHA-256 (HMAC-
signed with the run's key when one is set, naming the run), staged on this owner's
:class:`syncd.trainer.ft.replica_server.ReplicaServer` (``GET /v1/heal/<step>``, which asks for the job's token like
every replica route; the receiver presents it); the receiver checks size, signature, owner, step and run, and hashes
before the safetensors library or the bounded JSON reader sees a byte, all within the transfer's deadline
(:mod:`syncd.trainer.ft.replica_wire`). ``metadata()`` is the server's URL.

The sender serializes the state when asked (the Manager calls it inside the quorum, before the step may change
anything) and keeps the bytes until ``disallow_checkpoint()``, which waits for transfers in progress.
Thread-safety: the Manager calls it from its quorum thread; one transfer staged at a time.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
from datetime import timedelta

from syncd.trainer.ft.ckpt_format import (StateError, encode_manifest, frame_prefix, load_bundle, read_frame,
                                          write_safetensors)
from syncd.trainer.ft.state_tree import flatten, unflatten
from syncd.trainer.ft.replica_server import ReplicaServer
from syncd.trainer.ft.replica_wire import MIN_RATE
from syncd.trainer.ft.replicas import pull_frame

log = logging.getLogger(__name__)

__all__ = ["VerifiedTransport", "encode_state", "decode_state"]


def encode_state(owner: str, step: int, state, *, signing_key=None, run_id: str | None = None) -> bytes:
    """``state`` (any :func:`syncd.trainer.ft.state_tree.flatten`-able object) of run ``run_id`` as one framed
    bundle."""
    tensors, skeleton = flatten(state, "s")
    buf = io.BytesIO()
    tfile = write_safetensors(buf, tensors)
    doc = json.dumps(skeleton, allow_nan=False).encode()
    files = {"state.json": {"bytes": len(doc), "sha256": hashlib.sha256(doc).hexdigest()},
             "tensors.safetensors": tfile}
    raw = encode_manifest(owner, step, files, signing_key=signing_key, run_id=run_id)
    return frame_prefix(raw) + raw + doc + buf.getvalue()


def decode_state(frame_read, total: int | None, *, where: str, step: int | None = None, signing_key=None,
                 max_bytes: int = 1 << 40, run_id: str | None = None):
    """The state a framed bundle holds, after every check (its run ``run_id`` when given); StateError otherwise."""
    bundle = read_frame(frame_read, total, where=where, signing_key=signing_key, step=step, max_bytes=max_bytes,
                        run_id=run_id)
    tensors, skeleton = load_bundle(bundle, where=where)
    return unflatten(skeleton, tensors.get("tensors.safetensors", {}), where=where)


def _transport_base():
    from torchft.checkpointing.transport import CheckpointTransport

    return CheckpointTransport


class VerifiedTransport(_transport_base()):
    """See the module docstring. ``server``: this owner's replica server; ``owner``: its name; ``token``: the job's
    replica token (what the peers' servers ask for); ``run_id``: the run, named in and checked on every state."""

    def __init__(self, server: ReplicaServer, owner: str, *, signing_key=None, timeout_s: float = 120.0,
                 max_bytes: int = 1 << 40, token: str | None = None, run_id: str | None = None,
                 min_rate: float = MIN_RATE):
        self.server, self.owner, self.signing_key = server, owner, signing_key
        self.timeout_s, self.max_bytes, self.min_rate = timeout_s, max_bytes, min_rate
        self.token, self.run_id = token, run_id
        self.sent = self.received = 0

    def metadata(self) -> str:
        return self.server.url

    def send_checkpoint(self, dst_ranks, step: int, state_dict, timeout: timedelta) -> None:
        frame = encode_state(self.owner, step, state_dict, signing_key=self.signing_key, run_id=self.run_id)
        self.server.stage_heal(step, frame)
        self.sent += 1
        log.info("%s: live state of step %d staged for %s (%d bytes)", self.owner, step, dst_ranks, len(frame))

    def disallow_checkpoint(self) -> None:
        self.server.unstage_heal(self.timeout_s)

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta):
        url = str(metadata)
        t = max(1.0, timeout.total_seconds()) if timeout else self.timeout_s
        state = pull_frame(url, f"/v1/heal/{int(step)}", f"live state of step {step}", timeout_s=t,
                           first_s=2 * t,  # the peer may first wait up to its timeout to stage the state
                           min_rate=self.min_rate, token=self.token,
                           receive=lambda resp, length, where: decode_state(
                               resp.read, length, where=where, step=step, signing_key=self.signing_key,
                               max_bytes=self.max_bytes, run_id=self.run_id))
        if not isinstance(state, dict) or "user" not in state or "torchft" not in state:
            raise StateError(f"live state of step {step} from {url}: not a torchft state (user, torchft)")
        self.received += 1
        log.warning("%s: healed: received the live state of step %d from %s", self.owner, step, url)
        return state

    def shutdown(self, wait: bool = True) -> None:
        self.server.unstage_heal(1.0 if not wait else self.timeout_s)
