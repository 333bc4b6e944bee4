"""HMAC-SHA256 signing keys for manifests.

A :class:`SigningKey` holds the secret bytes and a short public fingerprint (``key_id``) that is written
next to every signature, so that a reader with another key can say *which* key signed a manifest without
learning anything about the secret.

Where the key comes from (first match wins), see :func:`key_from_env`:

* ``SYNCD_SIGNING_KEY``: the key itself. ``hex:<hex digits>`` and ``base64:<text>`` decode to raw bytes;
  any other value is used as its UTF-8 bytes.
* ``SYNCD_SIGNING_KEY_FILE``: a file whose content (trailing newline stripped) is read the same way.

Readers without a key accept unsigned manifests but refuse signed ones unless the operator opts out with
``--allow-unsigned`` (``SYNCD_ALLOW_UNSIGNED=1``): a forgotten key never silently turns checking off
(:func:`check_signature`, :data:`NO_KEY_HELP`).

A key shorter than 16 bytes is refused: an HMAC is only as strong as its key. Keys are never logged and
never appear in ``repr``. Objects of this module are immutable and thread-safe.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
from dataclasses import dataclass, field

from syncd.errors import SignatureError

ALGORITHM = "hmac-sha256"
MIN_KEY_BYTES = 16
ENV_KEY = "SYNCD_SIGNING_KEY"
ENV_KEY_FILE = "SYNCD_SIGNING_KEY_FILE"
ENV_ALLOW_UNSIGNED = "SYNCD_ALLOW_UNSIGNED"


@dataclass(frozen=True)
class SigningKey:
    """A manifest signing key. ``secret`` is raw bytes (at least 16); ``key_id`` is a 16-hex fingerprint."""

    secret: bytes = field(repr=False)

    def __post_init__(self):
        if not isinstance(self.secret, (bytes, bytearray)):
            raise TypeError("SigningKey.secret must be bytes")
        if len(self.secret) < MIN_KEY_BYTES:
            raise ValueError(
                f"signing key is {len(self.secret)} bytes; at least {MIN_KEY_BYTES} are required"
            )
        object.__setattr__(self, "secret", bytes(self.secret))

    @property
    def key_id(self) -> str:
        """Public fingerprint: the first 8 bytes of SHA-256("syncd-key-id" || secret), as hex."""
        return hashlib.sha256(b"syncd-key-id\0" + self.secret).hexdigest()[:16]

    def sign(self, message: bytes) -> str:
        """HMAC-SHA256 of ``message``, lower-case hex (64 characters)."""
        return hmac.new(self.secret, message, hashlib.sha256).hexdigest()

    def verify(self, message: bytes, mac_hex: str) -> bool:
        """Constant-time check of ``mac_hex`` against this key; never raises for a malformed MAC."""
        if not isinstance(mac_hex, str) or len(mac_hex) != 64:
            return False
        return hmac.compare_digest(self.sign(message), mac_hex)


def parse_key(text: str | bytes) -> SigningKey:
    """A key from its textual form (``hex:...``, ``base64:...``, or plain UTF-8); raises ``ValueError``."""
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


def key_from_env(environ=None) -> SigningKey | None:
    """The key configured by ``SYNCD_SIGNING_KEY`` or ``SYNCD_SIGNING_KEY_FILE``, or None if neither is set.

    Raises ``ValueError`` if a variable is set but the key is unusable (too short, bad encoding, unreadable
    file) -- a misconfigured key must never silently turn signing off.
    """
    env = os.environ if environ is None else environ
    value = env.get(ENV_KEY)
    if value:
        try:
            return parse_key(value)
        except ValueError as exc:
            raise ValueError(f"{ENV_KEY}: {exc}") from None
    path = env.get(ENV_KEY_FILE)
    if path:
        try:
            with open(path, "rb") as fh:
                raw = fh.read()
        except OSError as exc:
            raise ValueError(f"{ENV_KEY_FILE}={path!r} cannot be read: {exc}") from None
        try:
            return parse_key(raw.rstrip(b"\r\n").decode("utf-8", errors="strict"))
        except ValueError as exc:  # UnicodeDecodeError too
            raise ValueError(f"{ENV_KEY_FILE}={path!r}: {exc}") from None
    return None


class _Unchecked:
    """The type of :data:`UNCHECKED`."""

    def __repr__(self) -> str:
        return "syncd.signing.UNCHECKED"


#: ``signing_key=UNCHECKED``: no key, and signed manifests are read without checking (``--allow-unsigned``)
UNCHECKED = _Unchecked()


def env_flag(name: str, environ=None) -> bool:
    """A boolean ``SYNCD_*`` variable: unset/empty/0/false/no/off is False, 1/true/yes/on is True; anything
    else raises ``ValueError`` naming the variable."""
    value = (os.environ if environ is None else environ).get(name, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{name}={value!r} is not a boolean (use 1 or 0)")


def resolve_key(signing_key) -> SigningKey | None:
    """Normalise a user-facing ``signing_key`` argument.

    ``None`` means "take it from the environment" (:func:`key_from_env`); ``False`` and :data:`UNCHECKED`
    mean "no key, do not look at the environment"; a ``str``/``bytes`` is parsed with :func:`parse_key`; a
    ``SigningKey`` is returned as is.
    """
    if signing_key is None:
        return key_from_env()
    if signing_key is False or signing_key is UNCHECKED:
        return None
    if isinstance(signing_key, SigningKey):
        return signing_key
    if isinstance(signing_key, (str, bytes, bytearray)):
        return parse_key(signing_key)
    raise TypeError(f"signing_key must be None, False, str, bytes or SigningKey, not {type(signing_key).__name__}")


#: what an operator can do about a signed manifest that no key can check (every message names both variables)
NO_KEY_HELP = (f"set {ENV_KEY} or {ENV_KEY_FILE} (--signing-key-file) to verify it, or start with "
               "--allow-unsigned (SYNCD_ALLOW_UNSIGNED=1) to read it without checking")


def resolve_policy(signing_key) -> tuple[SigningKey | None, bool]:
    """``(key, allow_unsigned)`` for a ``signing_key`` argument (see :func:`resolve_key`): with
    :data:`UNCHECKED`, or ``None`` and ``SYNCD_ALLOW_UNSIGNED=1`` with no key in the environment, signed
    manifests are read without checking; otherwise a reader without a key refuses them."""
    if signing_key is UNCHECKED:
        return None, True
    key = resolve_key(signing_key)
    return key, key is None and signing_key is None and env_flag(ENV_ALLOW_UNSIGNED)


def check_signature(message_for, signature, key: SigningKey | None, where: str, *,
                    allow_unsigned: bool = False) -> None:
    """Enforce the reader's policy for one manifest.

    ``signature`` is the manifest's ``signature`` member (a dict or None); ``message_for(alg, key_id)``
    gives the bytes the MAC covers (so the algorithm and key id are authenticated too). With a key
    configured, a missing signature, another algorithm, or a MAC that does not verify raises
    :class:`SignatureError` naming ``where`` and both key fingerprints. Without a key, an unsigned manifest
    passes (the store does not sign), and a *signed* one raises :class:`SignatureError` unless
    ``allow_unsigned`` (the operator chose to read without checking): secure by default.
    """
    if key is None:
        if signature is not None and not allow_unsigned:
            theirs = signature.get("key_id") if isinstance(signature, dict) else None
            raise SignatureError(f"{where}: manifest is signed (key id {str(theirs)[:16]!r}) but no signing key is "
                                 f"configured; refusing to read it unchecked: {NO_KEY_HELP}")
        return
    if signature is None:
        raise SignatureError(
            f"{where}: manifest is unsigned, but a signing key is configured (key id {key.key_id}); "
            "refusing it"
        )
    if not isinstance(signature, dict) or set(signature) != {"alg", "key_id", "mac"}:
        raise SignatureError(f"{where}: manifest signature is malformed (expected alg, key_id, mac)")
    if signature["alg"] != ALGORITHM:
        raise SignatureError(f"{where}: manifest signature algorithm {signature['alg']!r:.40} is not {ALGORITHM}")
    theirs = signature["key_id"] if isinstance(signature["key_id"], str) else "?"
    if not key.verify(message_for(ALGORITHM, theirs), signature["mac"]):
        if theirs[:16] != key.key_id:
            why = f"it names key id {theirs[:16]!r}, the configured key is {key.key_id}"
        else:
            why = "the content was altered after signing"
        raise SignatureError(f"{where}: manifest signature does not verify ({why}); refusing it")


def signature_for(message_for, key: SigningKey) -> dict:
    """The ``signature`` member signed with ``key``; ``message_for`` as in :func:`check_signature`."""
    return {"alg": ALGORITHM, "key_id": key.key_id, "mac": key.sign(message_for(ALGORITHM, key.key_id))}
