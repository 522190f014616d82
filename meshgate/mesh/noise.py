"""Sans-I/O Noise handshakes (Noise spec rev. 34) on `cryptography` primitives.

Suite: 25519 / ChaChaPoly / SHA256. Patterns: NN, NNpsk0, NNpsk2, XX, XXpsk3,
IK, IKpsk1, IKpsk2 — the ones the published cacophony vectors cover (the
deferred patterns XX1/IK1 are not implemented). The mesh uses
Noise_XXpsk3_25519_ChaChaPoly_SHA256 (see docs/PROTOCOL.md).

No sockets, no clock: `write_message(payload) -> bytes` and
`read_message(bytes) -> payload`; after the last message `split()` gives the
two transport CipherStates. Every failure raises `NoiseError` (never a
lower-level exception) so callers can count and drop without leaking detail.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

DHLEN = 32
HASHLEN = 32
TAGLEN = 16
MAX_MESSAGE = 65535
MAX_NONCE = (1 << 64) - 1

# Message patterns: (pre-messages known to both sides, message token lists).
# Pre-message entries name whose static key is known in advance.
PATTERNS: dict[str, tuple[tuple[str, ...], tuple[tuple[str, ...], ...]]] = {
    "NN": ((), (("e",), ("e", "ee"))),
    "NNpsk0": ((), (("psk", "e"), ("e", "ee"))),
    "NNpsk2": ((), (("e",), ("e", "ee", "psk"))),
    "XX": ((), (("e",), ("e", "ee", "s", "es"), ("s", "se"))),
    "XXpsk3": ((), (("e",), ("e", "ee", "s", "es"), ("s", "se", "psk"))),
    "IK": (("rs",), (("e", "es", "s", "ss"), ("e", "ee", "se"))),
    "IKpsk1": (("rs",), (("e", "es", "s", "ss", "psk"), ("e", "ee", "se"))),
    "IKpsk2": (("rs",), (("e", "es", "s", "ss"), ("e", "ee", "se", "psk"))),
}


class NoiseError(Exception):
    """Handshake or decryption failure; the message never contains key material."""


# Noise nonces: 32 zero bits and the 64-bit counter (one struct call: this runs per packet)
_nonce = struct.Struct("<4xQ").pack  # ChaChaPoly: little-endian


def _hmac(key: bytes, data: bytes) -> bytes:
    return hmac.digest(key, data, "sha256")


def hkdf(ck: bytes, ikm: bytes, n: int) -> tuple[bytes, ...]:
    """Noise's HKDF (HMAC-SHA256), returning `n` (2 or 3) 32-byte outputs."""
    temp = _hmac(ck, ikm)
    o1 = _hmac(temp, b"\x01")
    o2 = _hmac(temp, o1 + b"\x02")
    if n == 2:
        return o1, o2
    return o1, o2, _hmac(temp, o2 + b"\x03")


def generate_private() -> bytes:
    return os.urandom(32)


def public_key(private: bytes) -> bytes:
    return X25519PrivateKey.from_private_bytes(private).public_key().public_bytes_raw()


def dh(private: bytes, public: bytes) -> bytes:
    """X25519; NoiseError for a low-order peer key (the shared secret would be all zero)."""
    try:
        peer = X25519PublicKey.from_public_bytes(public)
        return X25519PrivateKey.from_private_bytes(private).exchange(peer)
    except ValueError:  # low-order point: all-zero shared secret
        raise NoiseError("invalid public key") from None


class CipherState:
    __slots__ = ("_aead", "k", "n")

    def __init__(self, k: bytes | None = None) -> None:
        self.k = k
        self.n = 0
        self._aead = ChaCha20Poly1305(k) if k is not None else None

    def has_key(self) -> bool:
        return self.k is not None

    def encrypt_with_ad(self, ad: bytes, plaintext: bytes) -> bytes:
        if self._aead is None:
            return plaintext
        if self.n >= MAX_NONCE:
            raise NoiseError("nonce exhausted")
        out = self._aead.encrypt(_nonce(self.n), plaintext, ad)
        self.n += 1
        return out

    def decrypt_with_ad(self, ad: bytes, ciphertext: bytes) -> bytes:
        if self._aead is None:
            return ciphertext
        if self.n >= MAX_NONCE:
            raise NoiseError("nonce exhausted")
        try:
            out = self._aead.decrypt(_nonce(self.n), ciphertext, ad)
        except InvalidTag:
            raise NoiseError("decryption failed") from None
        self.n += 1
        return out

    def rekey(self) -> None:
        assert self.k is not None and self._aead is not None
        self.k = self._aead.encrypt(_nonce(MAX_NONCE), b"\x00" * 32, b"")[:32]
        self._aead = ChaCha20Poly1305(self.k)


_nonce_be = struct.Struct(">4xQ").pack  # AESGCM: big-endian


# ---------------------------------------------------------------------- transport AEADs
# The handshakes themselves always use ChaChaPoly (the published vectors, and old peers); the
# transport keys from Split() may seal with AES-256-GCM when both ends negotiated it
# (docs/PROTOCOL.md section 2.6). Nonces follow each cipher's Noise encoding: 32 zero bits and
# the 64-bit counter, little-endian for ChaChaPoly, big-endian for AESGCM.

Aead = ChaCha20Poly1305 | AESGCM


@dataclass(frozen=True)
class Suite:
    """One transport AEAD: its code on the wire, its name, how to key it, its nonce encoding."""

    code: int
    name: str
    make: Callable[[bytes], Aead]
    nonce: Callable[[int], bytes]


CHACHA20_POLY1305 = Suite(1, "chacha20-poly1305", ChaCha20Poly1305, _nonce)
AES_256_GCM = Suite(2, "aes-256-gcm", AESGCM, _nonce_be)
SUITES = {s.code: s for s in (CHACHA20_POLY1305, AES_256_GCM)}
CAP_AES = 0x01  # the capability bit a node offers: "AES instructions here" (AES-GCM is cheap)


def choose_suite(local_caps: int, peer_caps: int) -> Suite:
    """The one rule both ends apply: AES-256-GCM where both have AES instructions, else
    ChaCha20-Poly1305 (fast in software everywhere; AES without instructions is slow)."""
    return AES_256_GCM if local_caps & peer_caps & CAP_AES else CHACHA20_POLY1305


def cpu_has_aes(cpuinfo: str) -> bool:
    """Whether /proc/cpuinfo text lists AES instructions: 'aes' among the x86 'flags' or
    the arm64 'Features' of a processor."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features") and "aes" in value.split():
            return True
    return False


@functools.lru_cache(maxsize=1)
def _this_cpu_has_aes() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            return cpu_has_aes(f.read())
    except OSError:
        return False  # no /proc (not Linux): claim nothing, ChaCha20-Poly1305 is safe everywhere


def local_caps(setting: str = "auto") -> int:
    """This node's capability bits for the AEAD offer; `setting` is limits.aes_instructions:
    "auto" reads /proc/cpuinfo, "yes"/"no" override it (tests, odd hardware)."""
    if setting == "yes":
        return CAP_AES
    if setting == "no":
        return 0
    return CAP_AES if _this_cpu_has_aes() else 0


def rekey_key(k: bytes, suite: Suite = CHACHA20_POLY1305) -> bytes:
    """REKEY(k) from the Noise spec, for transport layers that manage nonces themselves."""
    return suite.make(k).encrypt(suite.nonce(MAX_NONCE), b"\x00" * 32, b"")[:32]


class SymmetricState:
    def __init__(self, protocol_name: bytes) -> None:
        self.h = protocol_name.ljust(HASHLEN, b"\x00") if len(protocol_name) <= HASHLEN else (
            hashlib.sha256(protocol_name).digest()
        )
        self.ck = self.h
        self.cs = CipherState()

    def mix_key(self, ikm: bytes) -> None:
        self.ck, temp_k = hkdf(self.ck, ikm, 2)
        self.cs = CipherState(temp_k)

    def mix_hash(self, data: bytes) -> None:
        self.h = hashlib.sha256(self.h + data).digest()

    def mix_key_and_hash(self, ikm: bytes) -> None:
        self.ck, temp_h, temp_k = hkdf(self.ck, ikm, 3)
        self.mix_hash(temp_h)
        self.cs = CipherState(temp_k)

    def encrypt_and_hash(self, plaintext: bytes) -> bytes:
        ct = self.cs.encrypt_with_ad(self.h, plaintext)
        self.mix_hash(ct)
        return ct

    def decrypt_and_hash(self, ciphertext: bytes) -> bytes:
        pt = self.cs.decrypt_with_ad(self.h, ciphertext)
        self.mix_hash(ciphertext)
        return pt

    def split(self) -> tuple[CipherState, CipherState]:
        k1, k2 = hkdf(self.ck, b"", 2)
        return CipherState(k1), CipherState(k2)


class HandshakeState:
    """One side of a Noise handshake.

    `s`/`e` are private keys (32 bytes); `e` is injectable only for test vectors.
    `rs` is the remote static public key for patterns that know it in advance.
    """

    def __init__(
        self,
        pattern: str,
        initiator: bool,
        prologue: bytes = b"",
        s: bytes | None = None,
        e: bytes | None = None,
        rs: bytes | None = None,
        psks: tuple[bytes, ...] = (),
    ) -> None:
        if pattern not in PATTERNS:
            raise ValueError(f"unsupported Noise pattern {pattern!r}")
        pre, messages = PATTERNS[pattern]
        self.pattern = pattern
        self.protocol_name = f"Noise_{pattern}_25519_ChaChaPoly_SHA256"
        self.initiator = initiator
        self.psk_mode = "psk" in pattern
        self.ss = SymmetricState(self.protocol_name.encode())
        self.ss.mix_hash(prologue)
        self.s = s
        self.s_pub = public_key(s) if s is not None else None
        self._fixed_e = e
        self.e: bytes | None = None
        self.e_pub: bytes | None = None
        self.rs = rs
        self.re: bytes | None = None
        self.psks = list(psks)
        for psk in self.psks:
            if len(psk) != 32:
                raise ValueError("a Noise PSK is 32 bytes")
        for who in pre:  # only responder-static pre-messages exist in PATTERNS
            assert who == "rs"
            key = self.rs if initiator else self.s_pub
            if key is None:
                raise ValueError(f"{pattern} needs the responder's static key in advance")
            self.ss.mix_hash(key)
        self._messages = list(messages)
        self._index = 0

    @property
    def finished(self) -> bool:
        return self._index >= len(self._messages)

    @property
    def handshake_hash(self) -> bytes:
        return self.ss.h

    def my_turn(self) -> bool:
        return (self._index % 2 == 0) == self.initiator

    def _take_psk(self) -> bytes:
        if not self.psks:
            raise NoiseError("pattern needs a PSK")
        return self.psks.pop(0)

    def _dh_token(self, token: str) -> bytes:
        e, s, re, rs = self.e, self.s, self.re, self.rs
        # Tokens name (initiator key, responder key); each side uses its own half.
        if token == "ee":
            a, b = e, re
        elif token == "ss":
            a, b = s, rs
        elif token == "es":
            a, b = (e, rs) if self.initiator else (s, re)
        else:  # "se"
            a, b = (s, re) if self.initiator else (e, rs)
        if a is None or b is None:
            raise NoiseError(f"missing key for {token}")
        return dh(a, b)

    def write_message(self, payload: bytes = b"") -> bytes:
        if self.finished or not self.my_turn():
            raise NoiseError("not our turn to write")
        out = bytearray()
        for token in self._messages[self._index]:
            if token == "e":
                self.e = self._fixed_e if self._fixed_e is not None else generate_private()
                self.e_pub = public_key(self.e)
                out += self.e_pub
                self.ss.mix_hash(self.e_pub)
                if self.psk_mode:
                    self.ss.mix_key(self.e_pub)
            elif token == "s":
                if self.s_pub is None:
                    raise NoiseError("no static key")
                out += self.ss.encrypt_and_hash(self.s_pub)
            elif token == "psk":
                self.ss.mix_key_and_hash(self._take_psk())
            else:
                self.ss.mix_key(self._dh_token(token))
        out += self.ss.encrypt_and_hash(payload)
        self._index += 1
        if len(out) > MAX_MESSAGE:
            raise NoiseError("handshake message too long")
        return bytes(out)

    def read_message(self, message: bytes) -> bytes:
        if self.finished or self.my_turn():
            raise NoiseError("not our turn to read")
        if len(message) > MAX_MESSAGE:
            raise NoiseError("handshake message too long")
        view = bytes(message)
        pos = 0
        for token in self._messages[self._index]:
            if token == "e":
                if len(view) - pos < DHLEN:
                    raise NoiseError("truncated handshake message")
                self.re = view[pos : pos + DHLEN]
                pos += DHLEN
                self.ss.mix_hash(self.re)
                if self.psk_mode:
                    self.ss.mix_key(self.re)
            elif token == "s":
                n = DHLEN + (TAGLEN if self.ss.cs.has_key() else 0)
                if len(view) - pos < n:
                    raise NoiseError("truncated handshake message")
                self.rs = self.ss.decrypt_and_hash(view[pos : pos + n])
                pos += n
            elif token == "psk":
                self.ss.mix_key_and_hash(self._take_psk())
            else:
                self.ss.mix_key(self._dh_token(token))
        if self.ss.cs.has_key() and len(view) - pos < TAGLEN:
            raise NoiseError("truncated handshake message")
        payload = self.ss.decrypt_and_hash(view[pos:])
        self._index += 1
        return payload

    def split(self) -> tuple[CipherState, CipherState]:
        """(initiator->responder, responder->initiator) cipher states."""
        if not self.finished:
            raise NoiseError("handshake not finished")
        return self.ss.split()
