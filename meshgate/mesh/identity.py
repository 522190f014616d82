"""A node's identity: one persistent key pair, and the node id derived from it.

Each node keeps an Ed25519 signing key (its route records, its HELLO) and the
X25519 key it uses as its Noise static key on every link, both in
STATE_DIR/identity.key (0600, in a 0700 directory). The public half is the 64
bytes `signing key || Noise key`; the node id is the first four bytes of
SHA-256("meshgate node id|" || public), so no node chooses its id and a record
or HELLO that names an id must carry the key that hashes to it
(docs/PROTOCOL.md section 9).

Text forms (what `meshgate key show` prints and `meshgate ca sign --pub` takes):
the public key as "mgk1:" + base64url without padding; a fingerprint as 64 hex
digits of SHA-256(public).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import os
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from meshgate.mesh.noise import generate_private, public_key

log = logging.getLogger("meshgate.mesh.identity")

KEY_FILE = "identity.key"
_FILE_HEADER = "meshgate identity v1"
PUBLIC_PREFIX = "mgk1:"
PUBLIC_LEN = 64  # Ed25519 public (32) || X25519 public (32)
SIGNATURE_LEN = 64


class IdentityError(ValueError):
    """A key file or public key text that cannot be used; the message names the path."""


def node_id_of(public: bytes) -> int:
    """The node id a public key (64 bytes) owns. Never 0: frames use 0 for 'no node'."""
    digest = hashlib.sha256(b"meshgate node id|" + public).digest()
    return int.from_bytes(digest[:4], "big") or 1


def fingerprint(public: bytes) -> str:
    return hashlib.sha256(public).hexdigest()


def public_text(public: bytes) -> str:
    return PUBLIC_PREFIX + base64.urlsafe_b64encode(public).rstrip(b"=").decode()


def parse_public(text: str) -> bytes:
    """The 64 bytes of a public key written by `public_text`; IdentityError otherwise."""
    text = text.strip()
    if not text.startswith(PUBLIC_PREFIX):
        raise IdentityError(f"a public key starts with {PUBLIC_PREFIX!r} (from `meshgate key show`)")
    body = text[len(PUBLIC_PREFIX):]
    try:
        raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
    except (binascii.Error, ValueError):
        raise IdentityError("the public key is not valid base64url") from None
    if len(raw) != PUBLIC_LEN:
        raise IdentityError(f"a public key is {PUBLIC_LEN} bytes, this one {len(raw)}")
    return raw


def verify(signing_key: bytes, signature: bytes, data: bytes) -> bool:
    """Whether `signature` is signing_key's Ed25519 signature of `data` (never raises)."""
    try:
        Ed25519PublicKey.from_public_bytes(signing_key).verify(signature, data)
    except (InvalidSignature, ValueError):
        return False
    return True


class Identity:
    """The private keys of one node. The repr shows the fingerprint only."""

    __slots__ = ("_signer", "dh_private", "dh_public", "node_id", "public", "signing_public")

    def __init__(self, signing_private: bytes, dh_private: bytes) -> None:
        self._signer = Ed25519PrivateKey.from_private_bytes(signing_private)
        self.signing_public = self._signer.public_key().public_bytes_raw()
        self.dh_private = dh_private
        self.dh_public = public_key(dh_private)
        self.public = self.signing_public + self.dh_public
        self.node_id = node_id_of(self.public)

    @classmethod
    def generate(cls) -> Identity:
        return cls(os.urandom(32), generate_private())

    def sign(self, data: bytes) -> bytes:
        return self._signer.sign(data)

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.public)

    def __repr__(self) -> str:
        return f"Identity(node {self.node_id:08x}, fingerprint {self.fingerprint[:16]}…)"

    def _private_bytes(self) -> bytes:
        return self._signer.private_bytes_raw() + self.dh_private


def load_or_create(state_dir: Path) -> Identity:
    """The identity in STATE_DIR/identity.key, made on first use. IdentityError (naming the
    file) when it exists but is unreadable or damaged: a node must never silently take a new
    identity, since its certificate and every peer's view of it are bound to the old one."""
    path = state_dir / KEY_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return _create(path)
    except OSError as e:
        raise IdentityError(f"node.state_dir: cannot read {path}: {e.strerror or e}") from None
    lines = text.split()
    try:
        if len(lines) != 4 or " ".join(lines[:3]) != _FILE_HEADER:
            raise ValueError
        raw = base64.b64decode(lines[3], validate=True)
        if len(raw) != 64:
            raise ValueError
    except (ValueError, binascii.Error):
        raise IdentityError(f"node.state_dir: {path} is not a meshgate identity key file") from None
    if path.stat().st_mode & 0o077:
        log.warning("node.state_dir: %s is readable by others; chmod 600 it", path)
    return Identity(raw[:32], raw[32:])


def _create(path: Path) -> Identity:
    ident = Identity.generate()
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"{_FILE_HEADER}\n{base64.b64encode(ident._private_bytes()).decode()}\n")
        os.replace(tmp, path)
    except OSError as e:
        raise IdentityError(f"node.state_dir: cannot write {path}: {e.strerror or e}") from None
    log.info("made a new node identity in %s (node %08x)", path, ident.node_id)
    return ident
