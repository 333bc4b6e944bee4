"""Signed manifests: which keys a party holds, where they come from, and the one reader policy.

The publisher signs each manifest with its private key; every other party (readers, node daemons, engines)
is configured with public keys only and can verify but never produce a manifest a reader accepts. Keys and
algorithms: :mod:`syncd.signing.keys` (Ed25519 by default; the legacy shared-secret HMAC form stays
readable for one release); their text and file format, and ``syncd keygen``'s files:
:mod:`syncd.signing.keyfiles`. The threat model (who holds what, who can do what): ``docs/layout.md``.

Where keys come from (:func:`key_from_env`):

* ``SYNCD_SIGNING_KEY``: a key as text (``ed25519-private:...``, ``ed25519-public:...``, or a legacy HMAC
  secret: ``hex:<hex digits>``, ``base64:<text>`` or any other UTF-8 text);
  else ``SYNCD_SIGNING_KEY_FILE`` (``--signing-key-file``): a file holding one. The publisher is given its
  private key this way; a verifier may be given one public key this way.
* ``SYNCD_VERIFY_KEYS`` (``--verify-key FILE``, repeatable): comma-separated public key files, all
  accepted at once and selected by the key id written next to each signature (a key rotation).

Readers without a key accept unsigned manifests but refuse signed ones unless the operator opts out with
``--allow-unsigned`` (``SYNCD_ALLOW_UNSIGNED=1``): a forgotten key never silently turns checking off
(:func:`check_signature`, :data:`NO_KEY_HELP`). Keys are never logged and never appear in ``repr``.
Everything here is immutable and thread-safe.
"""

from __future__ import annotations

import os

from syncd.errors import SignatureError
from syncd.signing.keyfiles import parse_key, parse_text, read_key_file, read_public_key_file
from syncd.signing.keys import (ED25519, HMAC, LABEL, MEMBER, MIN_KEY_BYTES, Keyring, PrivateKey, PublicKey,
                                SigningKey, as_keyring)

__all__ = ["SigningKey", "PrivateKey", "PublicKey", "Keyring", "ED25519", "HMAC", "LABEL", "MIN_KEY_BYTES",
           "ENV_KEY", "ENV_KEY_FILE", "ENV_VERIFY_KEYS", "ENV_ALLOW_UNSIGNED", "UNCHECKED", "NO_KEY_HELP",
           "parse_key", "key_from_env", "env_flag", "resolve_key", "resolve_policy", "check_signature",
           "signer_of", "signature_for", "describe_signature"]

ENV_KEY = "SYNCD_SIGNING_KEY"
ENV_KEY_FILE = "SYNCD_SIGNING_KEY_FILE"
ENV_VERIFY_KEYS = "SYNCD_VERIFY_KEYS"
ENV_ALLOW_UNSIGNED = "SYNCD_ALLOW_UNSIGNED"


def key_from_env(environ=None):
    """What ``SYNCD_SIGNING_KEY`` / ``SYNCD_SIGNING_KEY_FILE`` and ``SYNCD_VERIFY_KEYS`` configure, or None if
    none is set: the one key (a :class:`PrivateKey`, :class:`PublicKey` or legacy :class:`SigningKey`) when
    only the first two name one, else a :class:`Keyring` (the private or legacy key as its signer, every
    public key accepted).

    Raises ``ValueError`` naming the variable if one is set but unusable (bad format, unreadable file, a
    private key among the verify keys, two keys with one key id): a misconfigured key must never silently
    turn signing off.
    """
    env = os.environ if environ is None else environ
    key = None
    if env.get(ENV_KEY):
        try:
            key = parse_text(env[ENV_KEY])
        except ValueError as exc:
            raise ValueError(f"{ENV_KEY}: {exc}") from None
    elif env.get(ENV_KEY_FILE):
        key = read_key_file(env[ENV_KEY_FILE], ENV_KEY_FILE)
    paths = [p.strip() for p in env.get(ENV_VERIFY_KEYS, "").split(",") if p.strip()]
    if not paths:
        return key
    accepts = [read_public_key_file(p, ENV_VERIFY_KEYS) for p in paths]
    try:
        return Keyring(None, [key, *accepts]) if isinstance(key, PublicKey) else Keyring(key, accepts)
    except ValueError as exc:
        raise ValueError(f"{ENV_VERIFY_KEYS}: {exc}") from None


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


_KEYS = (SigningKey, PrivateKey, PublicKey, Keyring)


def resolve_key(signing_key):
    """Normalise a user-facing ``signing_key`` argument to a key object or None.

    ``None`` means "take it from the environment" (:func:`key_from_env`); ``False`` and :data:`UNCHECKED`
    mean "no key, do not look at the environment"; a ``str`` is a key's text (``ed25519-private:...``,
    ``ed25519-public:...`` or a legacy HMAC secret), ``bytes`` a legacy HMAC secret; a :class:`PrivateKey`,
    :class:`PublicKey`, :class:`SigningKey` or :class:`Keyring` is returned as is.
    """
    if signing_key is None:
        return key_from_env()
    if signing_key is False or signing_key is UNCHECKED:
        return None
    if isinstance(signing_key, _KEYS):
        return signing_key
    if isinstance(signing_key, str):
        return parse_text(signing_key)
    if isinstance(signing_key, (bytes, bytearray)):
        return parse_key(signing_key)
    raise TypeError("signing_key must be None, False, str, bytes, PrivateKey, PublicKey, SigningKey or Keyring, "
                    f"not {type(signing_key).__name__}")


#: what an operator can do about a signed manifest that no key can check (every message names the variables)
NO_KEY_HELP = (f"set {ENV_VERIFY_KEYS} (--verify-key: the publisher's public key file), or {ENV_KEY} or "
               f"{ENV_KEY_FILE} (--signing-key-file), to verify it, or start with --allow-unsigned "
               "(SYNCD_ALLOW_UNSIGNED=1) to read it without checking")


def resolve_policy(signing_key):
    """``(key, allow_unsigned)`` for a ``signing_key`` argument (see :func:`resolve_key`): with
    :data:`UNCHECKED`, or ``None`` and ``SYNCD_ALLOW_UNSIGNED=1`` with no key in the environment, signed
    manifests are read without checking; otherwise a reader without a key refuses them."""
    if signing_key is UNCHECKED:
        return None, True
    key = resolve_key(signing_key)
    return key, key is None and signing_key is None and env_flag(ENV_ALLOW_UNSIGNED)


def check_signature(message_for, signature, key, where: str, *, allow_unsigned: bool = False) -> None:
    """Enforce the reader's policy for one manifest (or any document signed the same way).

    ``signature`` is the document's ``signature`` member (a dict or None); ``message_for(alg, key_id)``
    gives the bytes the signature covers (so the algorithm and key id are authenticated too). ``key``: any
    key object (:func:`resolve_key`) or None. With a key, a missing signature, a malformed one, a key id
    that is not among the accepted keys, a key id of the other algorithm, or a signature that does not
    verify raises :class:`SignatureError` naming ``where`` and the key ids. Without one, an unsigned
    document passes, and a *signed* one raises :class:`SignatureError` unless ``allow_unsigned`` (the
    operator chose to read without checking): secure by default.
    """
    if key is None:
        if signature is not None and not allow_unsigned:
            theirs = signature.get("key_id") if isinstance(signature, dict) else None
            raise SignatureError(f"{where}: manifest is signed (key id {str(theirs)[:16]!r}) but no signing key is "
                                 f"configured; refusing to read it unchecked: {NO_KEY_HELP}")
        return
    ring = as_keyring(key)
    if signature is None:
        raise SignatureError(f"{where}: manifest is unsigned, but a signing key is configured "
                             f"({ring.describe()}); refusing it")
    alg = signature.get("alg") if isinstance(signature, dict) else None
    if isinstance(alg, str) and alg not in MEMBER:
        raise SignatureError(f"{where}: manifest signature algorithm {alg!r:.40} is not one of {sorted(MEMBER)}")
    if not isinstance(alg, str) or set(signature) != {"alg", "key_id", MEMBER[alg]}:
        raise SignatureError(f"{where}: manifest signature is malformed (expected alg, key_id and sig "
                             "(ed25519) or mac (hmac-sha256))")
    theirs = signature["key_id"] if isinstance(signature["key_id"], str) else "?"
    verifier = ring.find(theirs)
    if verifier is None:
        raise SignatureError(f"{where}: manifest signature does not verify (it names key id {theirs[:16]!r}, "
                             f"which is not accepted: {ring.describe()}); refusing it")
    if verifier.alg != alg:
        raise SignatureError(f"{where}: manifest signature claims {LABEL[alg]} but key id {theirs} is an "
                             f"{LABEL[verifier.alg]} key; refusing it")
    if not verifier.verify(message_for(alg, theirs), signature[MEMBER[alg]]):
        raise SignatureError(f"{where}: manifest signature does not verify (the content was altered after "
                             f"signing, or it was not signed by key {theirs}); refusing it")


def signer_of(key) -> SigningKey | PrivateKey:
    """The key that ``key`` signs with; ``ValueError`` when it cannot sign (a public key, or a keyring without
    a signer): what a publisher checks when it starts."""
    signer = as_keyring(key).signer
    if signer is None:
        raise ValueError("cannot sign: only public keys are configured (the publisher is given the private key "
                         f"file of `syncd keygen`, {ENV_KEY_FILE} / --signing-key-file)")
    return signer


def signature_for(message_for, key) -> dict:
    """The ``signature`` member signed with ``key``'s signer (``message_for`` as in :func:`check_signature`).
    ``ValueError`` when ``key`` cannot sign (:func:`signer_of`)."""
    signer = signer_of(key)
    return {"alg": signer.alg, "key_id": signer.key_id, MEMBER[signer.alg]: signer.sign(message_for(signer.alg,
                                                                                                 signer.key_id))}


def describe_signature(alg: str | None, key_id: str | None) -> str:
    """How ``syncd ls``/``verify`` name a verified signature: ``signed ed25519 key ID``, ``signed
    hmac-sha256 (legacy) key ID``, or ``unsigned / not checked`` when ``alg`` is None."""
    return "unsigned / not checked" if alg is None else f"signed {LABEL.get(alg, alg)} key {key_id}"
