"""Keys as text and as files: the one format ``syncd keygen`` writes and every party reads.

One line per file (trailing line breaks are ignored, nothing else is)::

    ed25519-private:<base64 of the 32-byte seed>                   PREFIX.key, mode 0600: the publisher's
    ed25519-public:<key id>:<base64 of the 32-byte public key>     PREFIX.pub: everybody else's

The key id in a public key file is checked against the key (a file edited by hand, or two files pasted
together, is refused). Legacy HMAC secrets keep their forms (``hex:<hex>``, ``base64:<text>``, or the
UTF-8 bytes of any other text, at least 16 bytes; :func:`parse_key`). Parsing is strict: text that starts
with ``ed25519`` but is not exactly one of the two lines above, a PEM file, a private key where a public
key is expected, each raise ``ValueError`` naming the flag or variable (``what``) and what is wrong -- a
mistyped key file never silently becomes an HMAC secret. Functions here are thread-safe.
"""

from __future__ import annotations

import base64
import binascii
import logging
import os
import re
import stat
from pathlib import Path

from syncd.signing.keys import ED25519_KEY_BYTES, PrivateKey, PublicKey, SigningKey

log = logging.getLogger(__name__)

PRIVATE_PREFIX = "ed25519-private:"
PUBLIC_PREFIX = "ed25519-public:"
MAX_KEY_FILE_BYTES = 1 << 16
_B64 = r"[A-Za-z0-9+/]{43}="
_PRIVATE_RE = re.compile(rf"^ed25519-private:(?P<b64>{_B64})$")
_PUBLIC_RE = re.compile(rf"^ed25519-public:(?P<key_id>[0-9a-f]{{16}}):(?P<b64>{_B64})$")
FORMAT_HELP = (f"expected one line '{PRIVATE_PREFIX}<base64>' or '{PUBLIC_PREFIX}<key id>:<base64>', as written "
               "by `syncd keygen`")


def parse_key(text: str | bytes) -> SigningKey:
    """A legacy HMAC secret from its textual form (``hex:...``, ``base64:...``, or plain UTF-8); raises
    ``ValueError``."""
    if isinstance(text, (bytes, bytearray)):
        return SigningKey(bytes(text))
    try:
        if text.startswith("hex:"):
            return SigningKey(bytes.fromhex(text[4:].strip()))
        if text.startswith("base64:"):
            return SigningKey(base64.b64decode(text[7:].strip(), validate=True))
    except (ValueError, binascii.Error) as exc:
        raise ValueError(f"signing key is not valid {text.split(':', 1)[0]}: {exc}") from None
    return SigningKey(text.encode("utf-8"))


def format_private(key: PrivateKey) -> str:
    """The private key file's line (with its newline)."""
    return f"{PRIVATE_PREFIX}{base64.b64encode(key.seed()).decode()}\n"


def format_public(key: PublicKey) -> str:
    """The public key file's line (with its newline)."""
    return f"{PUBLIC_PREFIX}{key.key_id}:{base64.b64encode(key.raw).decode()}\n"


def parse_text(text: str) -> SigningKey | PrivateKey | PublicKey:
    """Any key from its text (one line, see the module docstring): an Ed25519 private or public key, else a
    legacy HMAC secret. ``ValueError`` says what is wrong (never with the key's bytes in it)."""
    if text.startswith("-----BEGIN"):
        raise ValueError(f"a PEM file is not read; {FORMAT_HELP}")
    if text[:7].lower() != "ed25519":
        return parse_key(text)
    m = _PRIVATE_RE.match(text) or _PUBLIC_RE.match(text)
    if m is None:
        raise ValueError(f"not a valid ed25519 key line; {FORMAT_HELP}")
    raw = base64.b64decode(m.group("b64"), validate=True)
    if len(raw) != ED25519_KEY_BYTES:  # the pattern fixes the length; kept as the contract
        raise ValueError(f"an ed25519 key is {ED25519_KEY_BYTES} bytes, this one {len(raw)}")
    if text.startswith(PRIVATE_PREFIX):
        return PrivateKey(raw)
    key = PublicKey(raw)
    if key.key_id != m.group("key_id"):
        raise ValueError(f"the key id {m.group('key_id')} written in it is not the key's ({key.key_id}): the file "
                         "was edited or mixed up; copy PREFIX.pub from `syncd keygen` again")
    return key


def read_key_file(path, what: str) -> SigningKey | PrivateKey | PublicKey:
    """The key in the file at ``path`` (:func:`parse_text`). ``what`` (the flag or variable that named the
    file) starts every ``ValueError``: unreadable, over 64 KiB, not UTF-8, or not a key. A private key file
    that its group or others may read is logged as a warning."""
    where = f"{what}={str(path)!r}"
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_KEY_FILE_BYTES + 1)
            mode = os.fstat(fh.fileno()).st_mode
    except OSError as exc:
        raise ValueError(f"{where} cannot be read: {exc}") from None
    if len(raw) > MAX_KEY_FILE_BYTES:
        raise ValueError(f"{where} is over {MAX_KEY_FILE_BYTES} bytes: not a key file")
    try:
        key = parse_text(raw.rstrip(b"\r\n").decode("utf-8", errors="strict"))
    except ValueError as exc:  # UnicodeDecodeError too
        raise ValueError(f"{where}: {exc}") from None
    if isinstance(key, PrivateKey) and stat.S_IMODE(mode) & 0o077:
        log.warning("%s: the private key file may be read by its group or others (mode %o); chmod 600 it",
                    where, stat.S_IMODE(mode))
    return key


def read_public_key_file(path, what: str) -> PublicKey:
    """The Ed25519 public key in the file at ``path``; ``ValueError`` naming ``what`` for anything else (a
    private key or an HMAC secret included: a verifier is given public keys only)."""
    key = read_key_file(path, what)
    if isinstance(key, PrivateKey):
        raise ValueError(f"{what}={str(path)!r} holds a private key; verifiers are given the public key file "
                         "(PREFIX.pub written by `syncd keygen`), never the private one")
    if not isinstance(key, PublicKey):
        raise ValueError(f"{what}={str(path)!r} is not an ed25519 public key file; {FORMAT_HELP}")
    return key


def write_keypair(prefix) -> tuple[Path, Path, PrivateKey]:
    """Generate a key and write ``PREFIX.key`` (the private key, created with mode 0600) and ``PREFIX.pub``
    (the public key, 0644); returns both paths and the key. Neither file may exist already (``ValueError``:
    a key is never overwritten); ``OSError`` if the folder is not writable."""
    key = PrivateKey.generate()
    private, public = Path(f"{prefix}.key"), Path(f"{prefix}.pub")
    for path in (private, public):
        if path.exists():
            raise ValueError(f"{path} exists; keygen never overwrites a key (choose another --out)")
    _write_new(private, format_private(key), 0o600)
    try:
        _write_new(public, format_public(key.public), 0o644)
    except BaseException:
        private.unlink(missing_ok=True)
        raise
    return private, public, key


def _write_new(path: Path, text: str, mode: int) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except FileExistsError:
        raise ValueError(f"{path} exists; keygen never overwrites a key (choose another --out)") from None
    with os.fdopen(fd, "w", encoding="ascii") as fh:
        os.fchmod(fd, mode)  # the umask must not widen or narrow it
        fh.write(text)
        fh.flush()
        os.fsync(fd)
