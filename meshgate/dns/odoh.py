"""Oblivious DNS over HTTPS (RFC 9230), sans-I/O.

Bytes in, bytes out: config encoding and key ids, the target's key pair (from
a seed with HPKE DeriveKeyPair, or fresh), query sealing/opening and response
sealing/opening. No sockets and no clock; randomness that must be fresh per
message (the response nonce, the client's ephemeral key) is either drawn here
from `os.urandom` or passed in by the caller, which is how the vectors pin it.

Suite: HPKE base mode, DHKEM(X25519, HKDF-SHA256), HKDF-SHA256, AES-128-GCM
(the only one RFC 9230 deployments use; configs naming another are skipped).

Errors carry the HTTP status the RFC gives them (`OdohError.status`): an
unknown key id is 401, anything that fails to decrypt or parse is 400. The
messages never include key material or plaintext.
"""

from __future__ import annotations

import hmac
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from pyhpke import AEADId, CipherSuite, KDFId, KEMId, KEMKeyPair

MEDIA_TYPE = "application/oblivious-dns-message"
CONFIGS_PATH = "/.well-known/odohconfigs"

ODOH_VERSION = 0x0001
KEM_X25519_HKDF_SHA256 = 0x0020
KDF_HKDF_SHA256 = 0x0001
AEAD_AES_128_GCM = 0x0001

QUERY = 0x01
RESPONSE = 0x02

KEY_ID_LEN = 32  # Nh of HKDF-SHA256
ENC_LEN = 32  # Nenc of DHKEM(X25519)
TAG_LEN = 16
RESPONSE_NONCE_LEN = 16  # max(Nn, Nk) of AES-128-GCM
_AES_KEY_LEN = 16
_AES_NONCE_LEN = 12

# The largest well-formed query message: type, key id, and an encrypted part
# whose u16 length field caps it. The HTTP layers answer 413 above this.
MAX_MESSAGE_LEN = 1 + 2 + KEY_ID_LEN + 2 + 0xFFFF

_QUERY_INFO = b"odoh query"
_RESPONSE_EXPORT = b"odoh response"

SUITE = CipherSuite.new(KEMId.DHKEM_X25519_HKDF_SHA256, KDFId.HKDF_SHA256, AEADId.AES128_GCM)


class OdohError(Exception):
    """A message the other side sent cannot be used; `status` is the HTTP answer."""

    status = 400


class MalformedMessage(OdohError):
    """Lengths, type or padding are wrong (400)."""


class DecryptError(OdohError):
    """Authentication failed: wrong key, tampered bytes, bad `enc` (400)."""


class UnknownKeyId(OdohError):
    """The query names a key this target does not hold (401)."""

    status = 401


# --------------------------------------------------------------------------- HKDF (RFC 5869)
# Plain, unlabeled HKDF as RFC 9230 uses it for key ids and the response key.


def _extract(salt: bytes, ikm: bytes) -> bytes:
    return hmac.digest(salt, ikm, "sha256")  # an empty salt is HashLen zeros to HMAC


def _expand(prk: bytes, info: bytes, length: int) -> bytes:
    out = b""
    block = b""
    counter = 1
    while len(out) < length:
        block = hmac.digest(prk, block + info + bytes([counter]), "sha256")
        out += block
        counter += 1
    return out[:length]


# --------------------------------------------------------------------------- configs


@dataclass(frozen=True)
class ObliviousDoHConfigContents:
    kem_id: int
    kdf_id: int
    aead_id: int
    public_key: bytes

    def encode(self) -> bytes:
        return (
            struct.pack(">HHHH", self.kem_id, self.kdf_id, self.aead_id, len(self.public_key))
            + self.public_key
        )

    @property
    def supported(self) -> bool:
        return (
            self.kem_id == KEM_X25519_HKDF_SHA256
            and self.kdf_id == KDF_HKDF_SHA256
            and self.aead_id == AEAD_AES_128_GCM
            and len(self.public_key) == ENC_LEN
        )

    def key_id(self) -> bytes:
        """`Expand(Extract("", contents), "odoh key id", Nh)` (RFC 9230 section 6.2)."""
        return _expand(_extract(b"", self.encode()), b"odoh key id", KEY_ID_LEN)

    @classmethod
    def decode(cls, data: bytes) -> ObliviousDoHConfigContents:
        if len(data) < 8:
            raise MalformedMessage("config contents shorter than 8 bytes")
        kem_id, kdf_id, aead_id, pk_len = struct.unpack_from(">HHHH", data)
        if len(data) != 8 + pk_len:
            raise MalformedMessage("config public key length does not match the contents")
        return cls(kem_id, kdf_id, aead_id, bytes(data[8:]))


def encode_configs(contents: Iterable[ObliviousDoHConfigContents]) -> bytes:
    """`ObliviousDoHConfigs`: u16 total, then {u16 version, u16 length, contents}*."""
    body = b""
    for c in contents:
        enc = c.encode()
        body += struct.pack(">HH", ODOH_VERSION, len(enc)) + enc
    if len(body) > 0xFFFF:
        raise ValueError("too many configs for one ObliviousDoHConfigs")
    return struct.pack(">H", len(body)) + body


def decode_configs(data: bytes) -> list[ObliviousDoHConfigContents]:
    """Every config a client can use, in the server's order of preference.

    Configs with an unknown version or suite are skipped (RFC 9230 section 6.1:
    clients ignore what they do not support); framing errors raise.
    """
    if len(data) < 2:
        raise MalformedMessage("configs shorter than their length field")
    (total,) = struct.unpack_from(">H", data)
    if len(data) != 2 + total:
        raise MalformedMessage("configs length field does not match the body")
    out: list[ObliviousDoHConfigContents] = []
    pos = 2
    while pos < len(data):
        if pos + 4 > len(data):
            raise MalformedMessage("truncated config header")
        version, length = struct.unpack_from(">HH", data, pos)
        pos += 4
        if pos + length > len(data):
            raise MalformedMessage("truncated config contents")
        raw = data[pos : pos + length]
        pos += length
        if version != ODOH_VERSION:
            continue
        contents = ObliviousDoHConfigContents.decode(raw)
        if contents.supported:
            out.append(contents)
    return out


# --------------------------------------------------------------------------- keys


@dataclass(frozen=True)
class TargetKey:
    """One key pair a target serves, with its config and key id precomputed."""

    pair: KEMKeyPair = field(repr=False)
    config: ObliviousDoHConfigContents
    key_id: bytes

    @classmethod
    def from_pair(cls, pair: KEMKeyPair) -> TargetKey:
        pk = pair.public_key.to_public_bytes()
        config = ObliviousDoHConfigContents(
            KEM_X25519_HKDF_SHA256, KDF_HKDF_SHA256, AEAD_AES_128_GCM, pk
        )
        return cls(pair, config, config.key_id())

    @classmethod
    def from_seed(cls, seed: bytes) -> TargetKey:
        """HPKE DeriveKeyPair(seed): the same seed gives the same key as odoh-go."""
        return cls.from_pair(SUITE.kem.derive_key_pair(seed))

    @classmethod
    def generate(cls) -> TargetKey:
        return cls.from_seed(os.urandom(32))


# --------------------------------------------------------------------------- messages


@dataclass(frozen=True)
class ObliviousMessage:
    msg_type: int
    key_id: bytes
    encrypted: bytes

    def encode(self) -> bytes:
        return (
            struct.pack(">BH", self.msg_type, len(self.key_id))
            + self.key_id
            + struct.pack(">H", len(self.encrypted))
            + self.encrypted
        )

    @classmethod
    def decode(cls, data: bytes, expect_type: int) -> ObliviousMessage:
        if len(data) < 5:
            raise MalformedMessage("message shorter than its header")
        msg_type, kid_len = struct.unpack_from(">BH", data)
        if msg_type != expect_type:
            raise MalformedMessage(f"message type {msg_type} where {expect_type} was expected")
        pos = 3 + kid_len
        if pos + 2 > len(data):
            raise MalformedMessage("key id runs past the end of the message")
        (enc_len,) = struct.unpack_from(">H", data, pos)
        if pos + 2 + enc_len != len(data):
            raise MalformedMessage("encrypted message length does not match the body")
        return cls(msg_type, bytes(data[3:pos]), bytes(data[pos + 2 :]))


def encode_plaintext(dns_message: bytes | memoryview, padding: int = 0) -> bytes:
    """`ObliviousDoHMessagePlaintext`: u16-length DNS message, u16-length zeros."""
    if len(dns_message) > 0xFFFF or padding > 0xFFFF or padding < 0:
        raise ValueError("DNS message or padding does not fit a u16 length")
    return (
        struct.pack(">H", len(dns_message)) + dns_message + struct.pack(">H", padding) + bytes(padding)
    )


def decode_plaintext(data: bytes) -> bytes:
    """The DNS message; raises MalformedMessage on bad lengths or non-zero padding."""
    if len(data) < 4:
        raise MalformedMessage("plaintext shorter than its length fields")
    (n,) = struct.unpack_from(">H", data)
    if 2 + n + 2 > len(data):
        raise MalformedMessage("DNS message runs past the end of the plaintext")
    (pad,) = struct.unpack_from(">H", data, 2 + n)
    if 2 + n + 2 + pad != len(data):
        raise MalformedMessage("padding length does not match the plaintext")
    if data.count(0, 4 + n) != pad:
        raise MalformedMessage("padding is not all zeros")
    return bytes(data[2 : 2 + n])


# --------------------------------------------------------------------------- response keys


@dataclass(frozen=True)
class ResponseContext:
    """What both sides keep from one query to protect its response.

    `secret` is the HPKE export "odoh response"; `query_plain` is the whole
    serialized query plaintext, padding included, which salts the response key.
    """

    secret: bytes = field(repr=False)
    query_plain: bytes = field(repr=False)

    def _aead(self, nonce: bytes) -> tuple[AESGCM, bytes]:
        salt = self.query_plain + struct.pack(">H", len(nonce)) + nonce
        prk = _extract(salt, self.secret)
        key = _expand(prk, b"odoh key", _AES_KEY_LEN)
        aead_nonce = _expand(prk, b"odoh nonce", _AES_NONCE_LEN)
        return AESGCM(key), aead_nonce

    def seal_response(self, dns_message: bytes, padding: int = 0, nonce: bytes | None = None) -> bytes:
        """Target side. `nonce` is fresh random bytes unless a test pins it."""
        if nonce is None:
            nonce = os.urandom(RESPONSE_NONCE_LEN)
        if len(nonce) != RESPONSE_NONCE_LEN:
            raise ValueError("response nonce must be 16 bytes")
        aead, aead_nonce = self._aead(nonce)
        aad = struct.pack(">BH", RESPONSE, len(nonce)) + nonce
        ct = aead.encrypt(aead_nonce, encode_plaintext(dns_message, padding), aad)
        return ObliviousMessage(RESPONSE, nonce, ct).encode()

    def seal_response_into(
        self,
        out: memoryview | bytearray,
        dns_message: bytes | memoryview,
        padding: int = 0,
        nonce: bytes | None = None,
    ) -> int:
        """As `seal_response`, written straight into `out` (a pooled buffer's
        memory); returns the bytes written. Raises ValueError if it does not fit."""
        if nonce is None:
            nonce = os.urandom(RESPONSE_NONCE_LEN)
        if len(nonce) != RESPONSE_NONCE_LEN:
            raise ValueError("response nonce must be 16 bytes")
        plain = encode_plaintext(dns_message, padding)
        ct_len = len(plain) + TAG_LEN
        total = 3 + RESPONSE_NONCE_LEN + 2 + ct_len
        if total > len(out) or ct_len > 0xFFFF:
            raise ValueError("sealed response does not fit the buffer")
        header = struct.pack(">BH", RESPONSE, RESPONSE_NONCE_LEN) + nonce
        out[: len(header)] = header
        struct.pack_into(">H", out, len(header), ct_len)
        aead, aead_nonce = self._aead(nonce)
        start = len(header) + 2
        aead.encrypt_into(aead_nonce, plain, header, memoryview(out)[start : start + ct_len])
        return total

    def open_response(self, data: bytes) -> bytes:
        """Client side: the DNS message of the target's answer."""
        msg = ObliviousMessage.decode(data, RESPONSE)
        if len(msg.key_id) != RESPONSE_NONCE_LEN:
            raise MalformedMessage("response nonce is not 16 bytes")
        aead, aead_nonce = self._aead(msg.key_id)
        aad = struct.pack(">BH", RESPONSE, len(msg.key_id)) + msg.key_id
        try:
            plain = aead.decrypt(aead_nonce, msg.encrypted, aad)
        except InvalidTag:
            raise DecryptError("response does not authenticate") from None
        return decode_plaintext(plain)


def _query_aad(key_id: bytes) -> bytes:
    return struct.pack(">BH", QUERY, len(key_id)) + key_id


# --------------------------------------------------------------------------- client


def seal_query(
    config: ObliviousDoHConfigContents,
    dns_message: bytes,
    padding: int = 0,
    ephemeral: KEMKeyPair | None = None,
) -> tuple[bytes, ResponseContext]:
    """Client side: the oblivious query message and the context to open its answer."""
    if not config.supported:
        raise ValueError("unsupported ODoH config suite")
    key_id = config.key_id()
    pkr = SUITE.kem.deserialize_public_key(config.public_key)
    enc, ctx = SUITE.create_sender_context(pkr, info=_QUERY_INFO, eks=ephemeral)
    plain = encode_plaintext(dns_message, padding)
    ct = ctx.seal(plain, _query_aad(key_id))
    secret = ctx.export(_RESPONSE_EXPORT, RESPONSE_NONCE_LEN)
    return ObliviousMessage(QUERY, key_id, enc + ct).encode(), ResponseContext(secret, plain)


# --------------------------------------------------------------------------- target


class TargetKeys:
    """The keys a target accepts: the current one plus, after a rotation, the
    previous one, so queries sealed to a just-replaced config still open.

    Rotation is driven by the caller (the listener's timer): no clock here.
    """

    def __init__(self, current: TargetKey) -> None:
        self.current = current
        self.previous: TargetKey | None = None

    def rotate(self, new: TargetKey) -> None:
        self.previous, self.current = self.current, new

    def configs(self) -> bytes:
        """What `/.well-known/odohconfigs` serves: only the current key, so
        clients move to it; the previous one is accepted, not advertised."""
        return encode_configs([self.current.config])

    def find(self, key_id: bytes) -> TargetKey | None:
        if hmac.compare_digest(key_id, self.current.key_id):
            return self.current
        if self.previous is not None and hmac.compare_digest(key_id, self.previous.key_id):
            return self.previous
        return None

    def open_query(self, data: bytes) -> tuple[bytes, ResponseContext]:
        """The DNS query inside an oblivious query, and the context for its answer."""
        msg = ObliviousMessage.decode(data, QUERY)
        key = self.find(msg.key_id)
        if key is None:
            raise UnknownKeyId("no key with this key id")
        return open_query_with(key, msg)


def open_query_with(key: TargetKey, msg: ObliviousMessage) -> tuple[bytes, ResponseContext]:
    if len(msg.encrypted) < ENC_LEN + TAG_LEN:
        raise MalformedMessage("encrypted query shorter than enc and tag")
    enc, ct = msg.encrypted[:ENC_LEN], msg.encrypted[ENC_LEN:]
    try:
        ctx = SUITE.create_recipient_context(enc, key.pair.private_key, info=_QUERY_INFO)
        plain = ctx.open(ct, _query_aad(msg.key_id))
    except Exception:
        # pyhpke raises OpenError for a bad tag and ValueError from
        # cryptography for a low-order or malformed `enc`: all one 400.
        raise DecryptError("query does not decrypt") from None
    dns_message = decode_plaintext(plain)
    return dns_message, ResponseContext(ctx.export(_RESPONSE_EXPORT, RESPONSE_NONCE_LEN), plain)
