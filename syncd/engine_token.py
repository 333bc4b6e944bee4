"""The node's engine-control credential: a token file readable only by its owner.

Engine processes (``python -m syncd.engine.control_server``, the Dynamo worker) refuse every weight-control request that
does not present this token, and the node daemon presents it (``docs/engine.md``, "Who may drive an engine").
Both find the file the same way, :func:`token_path`: ``$SYNCD_ENGINE_TOKEN_FILE``, else
``$XDG_CONFIG_HOME/syncd/engine-token`` (``~/.config/syncd/engine-token``). Whichever starts first creates it
(:func:`load_or_create`: 32 random bytes as hex, mode 0600 in a 0700 directory, published by an atomic
link so nobody reads half a token); the other reads it. A file that grants any access to its group or to
others, or that belongs to another user, is refused (like ssh's private keys) -- whoever the reader is, root
included: a token others can read authenticates nobody, and one another user wrote is a token they know.

:func:`read_secret_file` and :func:`load_or_create_secret` are the same mechanism for any such secret file (the
trainer's replica secret uses them); ``what`` names the secret in errors.

Thread-safe; nothing is cached here.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

ENV_TOKEN_FILE = "SYNCD_ENGINE_TOKEN_FILE"
TOKEN_HEX_CHARS = 64


def token_path(path: str | os.PathLike | None = None) -> Path:
    """``path``, else ``$SYNCD_ENGINE_TOKEN_FILE``, else ``$XDG_CONFIG_HOME/syncd/engine-token``."""
    if path:
        return Path(path).expanduser()
    if os.environ.get(ENV_TOKEN_FILE):
        return Path(os.environ[ENV_TOKEN_FILE]).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base, "syncd", "engine-token")


def _check(path: Path, st: os.stat_result, what: str) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{what} file {path} is not a regular file")
    if st.st_mode & 0o077:
        raise ValueError(f"{what} file {path} is readable or writable by others (mode "
                         f"{stat.S_IMODE(st.st_mode):o}); refusing it: chmod 600 {path}")
    if st.st_uid != os.geteuid():
        raise ValueError(f"{what} file {path} belongs to uid {st.st_uid}, not to this user "
                         f"({os.geteuid()}); refusing it")


def read_secret_file(path: str | os.PathLike, *, what: str, hint: str = "") -> str:
    """The secret (:data:`TOKEN_HEX_CHARS` hex digits) in the file ``path``. ``ValueError`` naming ``what``, the
    file and ``hint`` if it is missing, unreadable, malformed, has loose permissions or belongs to another user."""
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        raise ValueError(f"no {what} at {p}{hint}") from None
    except OSError as exc:
        raise ValueError(f"{what} file {p} cannot be read: {exc}") from None
    try:
        _check(p, os.fstat(fd), what)
        text = os.read(fd, 4096).decode("ascii", errors="replace").strip()
    finally:
        os.close(fd)
    if len(text) != TOKEN_HEX_CHARS or any(c not in "0123456789abcdef" for c in text):
        raise ValueError(f"{what} file {p} does not hold one ({TOKEN_HEX_CHARS} hex digits)")
    return text


def load_or_create_secret(path: str | os.PathLike, *, what: str, hint: str = "") -> str:
    """The secret in the file ``path``, creating the file first if there is none (32 random bytes as hex, mode
    0600, its directory made 0700 if new, published by an atomic link: of two processes creating it at once,
    both end up with the first one's). ``ValueError`` as :func:`read_secret_file`."""
    p = Path(path)
    if not p.exists():
        p.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, (secrets.token_hex(TOKEN_HEX_CHARS // 2) + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, p)  # atomic, and fails if another process was first: then its secret is the one
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
    return read_secret_file(p, what=what, hint=hint)


_HINT = (f" ({ENV_TOKEN_FILE}): start the engine (it creates one) or point both the engine and the daemon at the "
         "same file")


def read_token(path: str | os.PathLike | None = None) -> str:
    """The token in the file (see :func:`token_path`). ``ValueError`` naming the file and
    ``SYNCD_ENGINE_TOKEN_FILE`` if it is missing, unreadable, malformed, has loose permissions or belongs to
    another user."""
    return read_secret_file(token_path(path), what="engine token", hint=_HINT)


def load_or_create(path: str | os.PathLike | None = None) -> str:
    """The token in the file, creating the file first if there is none (see the module docstring)."""
    return load_or_create_secret(token_path(path), what="engine token", hint=_HINT)
