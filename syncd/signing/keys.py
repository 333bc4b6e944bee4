"""The keys that sign and verify manifests, and the keyring that holds what one party has.

Two algorithms, named by the ``alg`` member of a signature:

* ``ed25519`` (the default for new runs): the publisher holds a :class:`PrivateKey`; every reader, daemon
  and engine holds :class:`PublicKey` objects only, which verify but cannot sign. A signature is 64 bytes,
  written as 128 lower-case hex digits in the member ``sig``.
* ``hmac-sha256`` (legacy, readable for one release): a shared secret (:class:`SigningKey`) that signs and
  verifies alike, so every verifier could also forge. The MAC is 64 hex digits in the member ``mac``.

Every key has a public ``key_id``: 16 hex digits (the first 8 bytes of a SHA-256 over a domain string and
the key; for Ed25519 the public key, for HMAC the secret), written next to each signature so that a
verifier can pick the key it needs and an error can say which key signed. The two algorithms use different
domains, so no key id of one is the key id of the other's key.

A :class:`Keyring` is what one party holds: at most one signing key, and the verifying keys it accepts,
selected by key id (several at once: a key rotation). A verifier of one algorithm never checks a signature
that claims the other. Secrets never appear in ``repr`` and are never logged. Every object here is
immutable and thread-safe; ``ValueError`` is raised for unusable key material.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

HMAC = "hmac-sha256"
ED25519 = "ed25519"
#: the signature member holding the signature bytes, by algorithm
MEMBER = {ED25519: "sig", HMAC: "mac"}
#: how ``syncd ls`` / ``syncd verify`` and error messages name each algorithm
LABEL = {ED25519: "ed25519", HMAC: "hmac-sha256 (legacy)"}
MIN_KEY_BYTES = 16
ED25519_KEY_BYTES = 32


def _fingerprint(domain: bytes, material: bytes) -> str:
    return hashlib.sha256(domain + material).hexdigest()[:16]


@dataclass(frozen=True)
class SigningKey:
    """A legacy HMAC-SHA256 key: ``secret`` is raw bytes (at least 16). It signs and verifies alike: whoever
    can check a manifest with it can also make one."""

    secret: bytes = field(repr=False)
    alg = HMAC

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
        """Public fingerprint: the first 8 bytes of SHA-256("syncd-key-id\\0" || secret), as hex."""
        return _fingerprint(b"syncd-key-id\0", self.secret)

    @property
    def verifier(self) -> "SigningKey":
        """The key that checks this key's signatures: the same secret."""
        return self

    def sign(self, message: bytes) -> str:
        """HMAC-SHA256 of ``message``, lower-case hex (64 characters)."""
        return hmac.new(self.secret, message, hashlib.sha256).hexdigest()

    def verify(self, message: bytes, mac_hex) -> bool:
        """Constant-time check of ``mac_hex`` against this key; never raises for a malformed MAC."""
        if not isinstance(mac_hex, str) or len(mac_hex) != 64:
            return False
        return hmac.compare_digest(self.sign(message), mac_hex)


class PublicKey:
    """An Ed25519 public key (32 raw bytes): verifies manifests, cannot sign them."""

    __slots__ = ("raw", "key_id", "_key")
    alg = ED25519

    def __init__(self, raw: bytes):
        if not isinstance(raw, (bytes, bytearray)) or len(raw) != ED25519_KEY_BYTES:
            raise ValueError(f"an ed25519 public key is {ED25519_KEY_BYTES} bytes")
        self.raw = bytes(raw)
        self._key = Ed25519PublicKey.from_public_bytes(self.raw)
        self.key_id = _fingerprint(b"syncd-key-id\0ed25519\0", self.raw)

    @property
    def verifier(self) -> "PublicKey":
        return self

    def verify(self, message: bytes, sig_hex) -> bool:
        """Whether ``sig_hex`` (128 hex digits) is this key's signature of ``message``; never raises for a
        malformed signature."""
        if not isinstance(sig_hex, str) or len(sig_hex) != 128:
            return False
        try:
            self._key.verify(bytes.fromhex(sig_hex), message)
        except (InvalidSignature, ValueError):
            return False
        return True

    def __eq__(self, other) -> bool:
        return isinstance(other, PublicKey) and other.raw == self.raw

    def __hash__(self) -> int:
        return hash(self.raw)

    def __repr__(self) -> str:
        return f"PublicKey(key_id={self.key_id})"


class PrivateKey:
    """An Ed25519 private key (its 32-byte seed): what the publisher signs with. ``public`` is its
    :class:`PublicKey`, which is what everybody else is given."""

    __slots__ = ("_key", "public")
    alg = ED25519

    def __init__(self, seed: bytes):
        if not isinstance(seed, (bytes, bytearray)) or len(seed) != ED25519_KEY_BYTES:
            raise ValueError(f"an ed25519 private key is a {ED25519_KEY_BYTES}-byte seed")
        self._key = Ed25519PrivateKey.from_private_bytes(bytes(seed))
        self.public = PublicKey(self._key.public_key().public_bytes(serialization.Encoding.Raw,
                                                                     serialization.PublicFormat.Raw))

    @classmethod
    def generate(cls) -> "PrivateKey":
        """A new key from the operating system's random source."""
        key = Ed25519PrivateKey.generate()
        return cls(key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                     serialization.NoEncryption()))

    @property
    def key_id(self) -> str:
        return self.public.key_id

    @property
    def verifier(self) -> PublicKey:
        return self.public

    def seed(self) -> bytes:
        """The secret 32-byte seed (for writing the key file; keep it out of logs)."""
        return self._key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                       serialization.NoEncryption())

    def sign(self, message: bytes) -> str:
        """The Ed25519 signature of ``message``, lower-case hex (128 characters)."""
        return self._key.sign(message).hex()

    def verify(self, message: bytes, sig_hex) -> bool:
        return self.public.verify(message, sig_hex)

    def __repr__(self) -> str:
        return f"PrivateKey(key_id={self.key_id})"


Signer = SigningKey | PrivateKey
Verifier = SigningKey | PublicKey


class Keyring:
    """What one party holds: ``signer`` (a :class:`PrivateKey`, a legacy :class:`SigningKey`, or None for a
    party that only verifies) and the keys it ``accepts``, selected by key id. The signer's own verifying key
    is always accepted. Two different keys with one key id raise ``ValueError``."""

    __slots__ = ("signer", "accepted")

    def __init__(self, signer: Signer | None = None, accepts=()):
        if signer is not None and not isinstance(signer, (SigningKey, PrivateKey)):
            raise TypeError(f"a keyring signs with a PrivateKey or SigningKey, not {type(signer).__name__}")
        accepted: dict[str, Verifier] = {}
        for key in ([signer.verifier] if signer is not None else []) + [k.verifier for k in accepts]:
            if not isinstance(key, (SigningKey, PublicKey)):
                raise TypeError(f"a keyring accepts PublicKey or SigningKey objects, not {type(key).__name__}")
            if accepted.setdefault(key.key_id, key) != key:
                raise ValueError(f"two different keys have the key id {key.key_id}")
        self.signer, self.accepted = signer, accepted

    @property
    def key_id(self) -> str | None:
        """The signer's key id (None: this party cannot sign)."""
        return None if self.signer is None else self.signer.key_id

    def find(self, key_id) -> Verifier | None:
        """The accepted key with ``key_id``, or None."""
        return self.accepted.get(key_id) if isinstance(key_id, str) else None

    def describe(self) -> str:
        """``the configured key is ID (ALG)`` or ``the configured keys are ID (ALG), ...``, for messages."""
        keys = ", ".join(f"{k} ({LABEL[v.alg]})" for k, v in sorted(self.accepted.items()))
        return f"the configured key{' is' if len(self.accepted) == 1 else 's are'} {keys or 'none'}"

    def __repr__(self) -> str:
        return f"Keyring(signer={self.key_id}, accepts={sorted(self.accepted)})"


def as_keyring(key) -> Keyring:
    """``key`` (a :class:`Keyring`, :class:`PrivateKey`, :class:`PublicKey` or :class:`SigningKey`) as a
    :class:`Keyring`; ``TypeError`` for anything else."""
    if isinstance(key, Keyring):
        return key
    if isinstance(key, (SigningKey, PrivateKey)):
        return Keyring(key)
    if isinstance(key, PublicKey):
        return Keyring(None, [key])
    raise TypeError(f"not a signing or verifying key: {type(key).__name__}")
