"""The job's replica secret: what authenticates every replica transfer between the owners of one job
(:mod:`syncd.trainer.ft.replica_wire`), as the engine token authenticates engine control on one node.

It is a file of 64 hex digits, mode 0600, owned by the user running the job (the engine token's mechanism,
:func:`syncd.engine_token.load_or_create_secret`: a file others can read, or another user's, is refused):

* ``$SYNCD_REPLICA_SECRET_FILE`` when set (created there if absent), else
* ``<checkpoint-dir>/replica-secret``, created by the first process of the job that needs it.

A plain data-parallel job's rank 0 reads (or creates) it and hands it to every rank over the job's process group,
so ranks on other nodes need nothing. The replica groups of an elastic job each read it themselves: groups that
share a checkpoint folder share the file; groups on several nodes need the same secret on each (copy the file, or
point ``SYNCD_REPLICA_SECRET_FILE`` at a copy on each node) -- a group with another secret is refused by its peers
(HTTP 401, logged and counted by the replicator). The transfers of a run use a token derived from the secret and
the run id (:func:`syncd.trainer.ft.replica_wire.replica_token`).

Thread-safe; nothing is cached.
"""

from __future__ import annotations

import os
from pathlib import Path

from syncd.engine_token import load_or_create_secret

__all__ = ["ENV_SECRET_FILE", "SECRET_NAME", "secret_path", "job_secret"]

ENV_SECRET_FILE = "SYNCD_REPLICA_SECRET_FILE"
SECRET_NAME = "replica-secret"


def secret_path(checkpoint_dir) -> Path:
    """Where the job's replica secret is: ``$SYNCD_REPLICA_SECRET_FILE``, else ``checkpoint_dir/replica-secret``."""
    env = os.environ.get(ENV_SECRET_FILE)
    return Path(env).expanduser() if env else Path(checkpoint_dir) / SECRET_NAME


def job_secret(checkpoint_dir) -> str:
    """The job's replica secret (created if there is none yet). ValueError naming the file (and
    ``SYNCD_REPLICA_SECRET_FILE``) when it is loose, malformed or another user's."""
    return load_or_create_secret(secret_path(checkpoint_dir), what="replica secret",
                                 hint=f" ({ENV_SECRET_FILE})")
