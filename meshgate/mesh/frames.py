"""Sans-I/O link protocol: preface, Noise handshake, sealed records, inner frames.

Wire format (docs/PROTOCOL.md has the full text):

    preface      = MAGIC (4) | VERSION (1) | 0 (1)            each side, once
    handshake    = u16 length | Noise message                  XXpsk3, 3 messages;
                   msg1's payload the AEAD offer, msg2's the answer (empty from old peers)
    record       = u32 length | epoch u8 | counter u64 | AEAD(ciphertext+tag)
    plaintext    = frame*                                       many frames per record
    frame        = type u8 | flags u8 | hop u8 | 0 | u16 body length | src u32 | dst u32 | body

The record header (length, epoch, counter) is the AEAD's associated data; the
nonce is `0^32 || counter (LE 64)` as in Noise, sent explicitly so a receiver
keeps a replay window (64 records) and links that reorder (ring, future
datagram links) still work. The sender rekeys (Noise REKEY) every
`rekey_after` records and bumps the epoch; the receiver follows.

`LinkCodec` holds no socket and reads no clock: `receive(data)` consumes
bytes and calls `on_frame(...)`, `send_frame(...)` / `flush()` produce bytes
chunks for the adapter to write with one `writelines`.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.kdf.argon2 import Argon2id

from meshgate.mesh.noise import (
    CHACHA20_POLY1305,
    Aead,
    HandshakeState,
    NoiseError,
    Suite,
    choose_suite,
    generate_private,
    rekey_key,
)

MAGIC = b"MGMx"
# 3: node keys; the HELLO and route records are signed (2: the PSK from Argon2id; 1: HKDF).
# docs/PROTOCOL.md section 8
VERSION = 3
PREFACE = MAGIC + bytes((VERSION, 0))
NOISE_PATTERN = "XXpsk3"

# frame types
HELLO = 0x01
PING = 0x02
PONG = 0x03
ROUTES = 0x04
ROUTE_ACK = 0x05
REVOCATION = 0x06  # a CA's signed revocation list, flooded (certificate mode)
STREAM_OPEN = 0x10
STREAM_ACCEPT = 0x11
STREAM_DATA = 0x12
STREAM_WINDOW = 0x13
STREAM_FIN = 0x14
STREAM_RESET = 0x15
DATAGRAM = 0x20
# end to end between the two nodes that terminate the traffic (mesh/e2e.py)
E2E_INIT = 0x30  # Noise IK message 1
E2E_RESP = 0x31  # Noise IK message 2
SEALED = 0x32  # a stream frame sealed end to end (type and flags inside)
DATAGRAM_SEALED = 0x33  # a datagram sealed end to end
UNREACHABLE = 0x34  # from a relay: it could not deliver to a node (body: node id u32, code u8)
TRAVERSAL = 0x35  # NAT traversal call: endpoints, "probe me now" (mesh/traversal.py); sealed when relayed
# frames a udp:// link carries unreliably (everything else takes its reliable channel)
UNRELIABLE = frozenset((DATAGRAM, DATAGRAM_SEALED))
FRAME_NAMES = {
    HELLO: "hello", PING: "ping", PONG: "pong", ROUTES: "routes", ROUTE_ACK: "route_ack",
    REVOCATION: "revocation",
    STREAM_OPEN: "stream_open", STREAM_ACCEPT: "stream_accept", STREAM_DATA: "stream_data",
    STREAM_WINDOW: "stream_window", STREAM_FIN: "stream_fin", STREAM_RESET: "stream_reset",
    DATAGRAM: "datagram", E2E_INIT: "e2e_init", E2E_RESP: "e2e_resp", SEALED: "sealed",
    DATAGRAM_SEALED: "datagram_sealed", UNREACHABLE: "unreachable", TRAVERSAL: "traversal",
}
# Link-local frames are consumed by the neighbour; everything else is routed end to end.
LINK_LOCAL = frozenset((HELLO, PING, PONG, ROUTES, ROUTE_ACK, REVOCATION))

# flags
FLAG_OPENER = 0x01  # stream frame sent by the side that opened the stream
FLAG_LATENCY = 0x02  # route this frame by least latency (else least hop)
FLAG_AES = 0x04  # E2E_INIT: the initiator has AES instructions (its AEAD offer, mesh/e2e.py)

DEFAULT_HOP_LIMIT = 8

FRAME = struct.Struct("!BBBxHII")
FRAME_SIZE = FRAME.size
RECORD = struct.Struct("!IBQ")  # length (of epoch+counter+ciphertext), epoch, counter
RECORD_SIZE = RECORD.size
RECORD_EXTRA = RECORD_SIZE - 4  # bytes of the header inside `length`
TAG = 16
MIN_RECORD = RECORD_EXTRA + TAG  # the least `length`: an empty plaintext
MAX_PLAINTEXT = 1 << 16
MAX_BODY = MAX_PLAINTEXT - FRAME_SIZE
MAX_PENDING = MAX_PLAINTEXT - FRAME_SIZE  # a record's plaintext before one more frame's header
MAX_RECORD = MAX_PLAINTEXT + TAG + RECORD_EXTRA
REPLAY_WINDOW = 64
WINDOW_MASK = (1 << REPLAY_WINDOW) - 1
DEFAULT_REKEY_AFTER = 1 << 30  # records per key: far below the 2^64 nonce space

HELLO_BODY = struct.Struct("!IIB")  # node id, session, name length; then name, key, cert, signature
U32 = struct.Struct("!I")
U64 = struct.Struct("!Q")


class LinkError(Exception):
    """The link must close: broken framing, bad preface, failed handshake."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason  # short, for a counter label


# Argon2id cost (RFC 9106; the OWASP baseline for interactive use): 19 MiB, 2 passes, one
# lane. A node pays it once per process start (~45 ms here); an offline guesser pays it per
# guess. Changing it changes every PSK: it is part of the protocol version.
PSK_MEMORY_KIB = 19 * 1024
PSK_ITERATIONS = 2
PSK_LANES = 1
PSK_SALT = b"meshgate mesh psk v2|"


@functools.lru_cache(maxsize=8)  # once per process start for each network (tests run many nodes)
def derive_psk(network: str, secret: str) -> bytes:
    """PSK = Argon2id(secret, salt = "meshgate mesh psk v2|" || network name), 32 bytes."""
    return Argon2id(
        salt=PSK_SALT + network.encode(), length=32, iterations=PSK_ITERATIONS, lanes=PSK_LANES,
        memory_cost=PSK_MEMORY_KIB,
    ).derive(secret.encode())


def prologue(network: str) -> bytes:
    return b"meshgate mesh|" + PREFACE + b"|" + network.encode()


@dataclass(frozen=True)
class Hello:
    """The first sealed frame on a link: who the sender is. `key` is its 64-byte public key
    (identity.py), `cert` its node certificate (certificate mode) or empty, `signature` its
    Ed25519 signature of `hello_signed_data` for this link's handshake."""

    node_id: int
    session: int
    name: str
    key: bytes = b""
    cert: bytes = b""
    signature: bytes = b""


HelloBody = Callable[[bytes, bool], bytes]  # (handshake hash, we initiated) -> the HELLO body


def hello_signed_data(handshake_hash: bytes, initiator: bool) -> bytes:
    """What a HELLO's signature covers: this link's Noise handshake hash (so a HELLO cannot be
    replayed on another link) and the sender's role (so it cannot be reflected)."""
    return b"meshgate hello|" + (b"i" if initiator else b"r") + handshake_hash


def encode_hello(h: Hello) -> bytes:
    name = h.name.encode()[:255]
    return (HELLO_BODY.pack(h.node_id, h.session, len(name)) + name + bytes((len(h.key),)) + h.key
            + len(h.cert).to_bytes(2, "big") + h.cert + bytes((len(h.signature),)) + h.signature)


def decode_hello(body: bytes | memoryview) -> Hello:
    body = bytes(body)
    if len(body) < HELLO_BODY.size:
        raise LinkError("bad_hello", "truncated hello")
    node_id, session, n = HELLO_BODY.unpack_from(body)
    pos = HELLO_BODY.size
    try:
        name = body[pos : pos + n].decode("utf-8", "replace")
        pos += n
        klen = body[pos]
        key = body[pos + 1 : pos + 1 + klen]
        pos += 1 + klen
        clen = int.from_bytes(body[pos : pos + 2], "big")
        cert = body[pos + 2 : pos + 2 + clen]
        pos += 2 + clen
        slen = body[pos]
        signature = body[pos + 1 : pos + 1 + slen]
        pos += 1 + slen
    except IndexError:
        raise LinkError("bad_hello", "truncated hello") from None
    if pos != len(body) or len(key) != klen or len(cert) != clen or len(signature) != slen:
        raise LinkError("bad_hello", "bad hello length")
    return Hello(node_id, session, name, key, cert, signature)


# The transport AEAD offer (docs/PROTOCOL.md section 2.6), carried in the Noise payloads so the
# transcript (every later handshake message's AD, and the HELLO signatures) binds it: msg1's
# payload starts OFFER_V1, the initiator's capability bits (noise.CAP_AES); a new responder's
# msg2 payload is OFFER_V1, the suite it chose, its capability bits. Peers from before the offer
# send (byte pipes: empty; udp://: zeros) and ignore payloads: ChaCha20-Poly1305, as before.
OFFER_V1 = 0x01


def aead_offer(caps: int) -> bytes:
    """Initiator: the start of msg1's payload."""
    return bytes((OFFER_V1, caps & 0xFF))


def offered_caps(offer: bytes) -> int | None:
    """The initiator's capability bits in msg1's payload; None: no offer (a peer from before it)."""
    return offer[1] if len(offer) >= 2 and offer[0] == OFFER_V1 else None


def answer_offer(caps: int, offer: bytes) -> tuple[Suite, bytes]:
    """Responder: (the suite, msg2's payload) for msg1's payload. No offer (an initiator from
    before it): ChaCha20-Poly1305 and an empty payload, exactly what such a peer got before."""
    theirs = offered_caps(offer)
    if theirs is not None:
        suite = choose_suite(caps, theirs)
        return suite, bytes((OFFER_V1, suite.code, caps & 0xFF))
    return CHACHA20_POLY1305, b""


def answered_suite(caps: int, answer: bytes) -> Suite:
    """Initiator: the suite msg2's payload names, which must be what the rule gives for both
    ends' capabilities (authenticated, like all of msg2: a mismatch is a broken peer)."""
    if not answer:
        return CHACHA20_POLY1305  # a responder from before the offer
    if len(answer) != 3 or answer[0] != OFFER_V1:
        raise LinkError("bad_aead", "malformed AEAD answer in the handshake")
    expected = choose_suite(caps, answer[2])
    if answer[1] != expected.code:
        raise LinkError("bad_aead", f"the peer chose AEAD {answer[1]}, the rule gives {expected.name}")
    return expected


class SendCipher:
    """Seals records with one direction's key; `suite`: the negotiated AEAD (AES-256-GCM where
    both ends have AES instructions, else ChaCha20-Poly1305)."""

    __slots__ = ("_aead", "counter", "epoch", "key", "nonce", "rekey_after", "suite")

    def __init__(
        self, key: bytes, rekey_after: int = DEFAULT_REKEY_AFTER, suite: Suite = CHACHA20_POLY1305
    ) -> None:
        self.key = key
        self.suite = suite
        self._aead = suite.make(key)  # reused: building one per record costs more than sealing
        self.nonce = suite.nonce
        self.epoch = 0
        self.counter = 0
        self.rekey_after = rekey_after

    def seal(self, plaintext: bytes | bytearray | memoryview) -> tuple[bytes, bytes]:
        """(header, ciphertext): write both, in order."""
        if self.counter >= self.rekey_after:
            self.next_epoch()
        counter = self.counter
        self.counter = counter + 1
        header = RECORD.pack(len(plaintext) + MIN_RECORD, self.epoch, counter)
        return header, self._aead.encrypt(self.nonce(counter), plaintext, header)

    def seal_batch(self, prefix: bytes, plaintexts: list[bytes], out: list[bytes]) -> None:
        """One record per plaintext, each appended to `out` as prefix || header || ciphertext
        (udp:// data packets): seal's work with the per-call lookups once per batch."""
        aead, nonce, epoch, counter = self._aead, self.nonce, self.epoch, self.counter
        pack, join, extra, limit = RECORD.pack, b"".join, TAG + RECORD_EXTRA, self.rekey_after
        for plain in plaintexts:
            if counter >= limit:
                self.next_epoch()
                aead, epoch, counter = self._aead, self.epoch, 0
            header = pack(len(plain) + extra, epoch, counter)
            out.append(join((prefix, header, aead.encrypt(nonce(counter), plain, header))))
            counter += 1
        self.counter = counter

    def next_epoch(self) -> None:
        """REKEY: the next key and epoch, the counter from 0 (after `rekey_after` records)."""
        self.key = rekey_key(self.key, self.suite)
        self._aead = self.suite.make(self.key)
        self.epoch = (self.epoch + 1) & 0xFF
        self.counter = 0


class _Window:
    """Sliding replay window over record counters of one key epoch."""

    __slots__ = ("bitmap", "highest")

    def __init__(self) -> None:
        self.highest = -1
        self.bitmap = 0  # bit i set: counter (highest - i) seen

    def check(self, counter: int) -> bool:
        if counter > self.highest:
            return True
        d = self.highest - counter
        return d < REPLAY_WINDOW and not (self.bitmap >> d) & 1

    def mark(self, counter: int) -> None:
        if counter > self.highest:
            shift = counter - self.highest
            self.bitmap = ((self.bitmap << shift) | 1) & WINDOW_MASK if shift < REPLAY_WINDOW else 1
            self.highest = counter
        else:
            self.bitmap |= 1 << (self.highest - counter)


class RecvCipher:
    """Opens records; keeps the previous epoch's key for stragglers on reordering links."""

    __slots__ = ("_aead", "_prev", "epoch", "key", "nonce", "suite", "window")

    def __init__(self, key: bytes, suite: Suite = CHACHA20_POLY1305) -> None:
        self.key = key
        self.suite = suite
        self._aead = suite.make(key)
        self.nonce = suite.nonce
        self.epoch = 0
        self.window = _Window()
        self._prev: tuple[int, Aead, _Window] | None = None

    def current(self) -> tuple[Callable[[bytes, memoryview, memoryview], bytes], Callable[[int], bytes],
                               _Window, int]:
        """(decrypt, nonce, window, epoch) of the current key: udp:// links open a batch of
        packets with them inline (UdpSession.receive_batch), records of other epochs by `open`."""
        return self._aead.decrypt, self.nonce, self.window, self.epoch

    def open(self, header: bytes | memoryview, epoch: int, counter: int, ct: memoryview) -> bytes | None:
        """Plaintext, or None when replayed/out of window/forged (the caller counts it)."""
        if epoch == self.epoch:
            # the per-packet path of udp:// links: the window's check and mark inline
            w = self.window
            hi = w.highest
            if counter > hi:
                try:
                    plain = self._aead.decrypt(self.nonce(counter), ct, header)
                except InvalidTag:
                    return None
                shift = counter - hi
                w.bitmap = ((w.bitmap << shift) | 1) & WINDOW_MASK if shift < REPLAY_WINDOW else 1
                w.highest = counter
                return plain
            d = hi - counter
            if d >= REPLAY_WINDOW or (w.bitmap >> d) & 1:
                return None
            try:
                plain = self._aead.decrypt(self.nonce(counter), ct, header)
            except InvalidTag:
                return None
            w.bitmap |= 1 << d
            return plain
        return self._open_other(header, epoch, counter, ct)

    def _open_other(
        self, header: bytes | memoryview, epoch: int, counter: int, ct: memoryview
    ) -> bytes | None:
        """A record of the next epoch (the sender rekeyed) or of the previous one (a straggler)."""
        if epoch == (self.epoch + 1) & 0xFF:
            next_key = rekey_key(self.key, self.suite)
            aead, window = self.suite.make(next_key), _Window()
            try:
                plain = aead.decrypt(self.nonce(counter), ct, header)
            except InvalidTag:
                return None
            self._prev = (self.epoch, self._aead, self.window)
            self.key, self._aead, self.epoch, self.window = next_key, aead, epoch, window
            window.mark(counter)
            return plain
        elif self._prev is not None and epoch == self._prev[0]:
            _, aead, window = self._prev
        else:
            return None
        if not window.check(counter):
            return None
        try:
            plain = aead.decrypt(self.nonce(counter), ct, header)
        except InvalidTag:
            return None
        window.mark(counter)
        return plain


FrameHandler = Callable[[int, int, int, int, int, memoryview], None]


def iter_frames(plain: bytes, on_frame: FrameHandler) -> int:
    """Parse a record's plaintext into frames; returns how many were malformed (0 or 1)."""
    view = memoryview(plain)
    pos, end = 0, len(plain)
    unpack = FRAME.unpack_from
    hsize = FRAME.size
    while pos < end:
        if end - pos < hsize:
            return 1
        ftype, flags, hop, length, src, dst = unpack(plain, pos)
        pos += hsize
        if end - pos < length:
            return 1
        on_frame(ftype, flags, hop, src, dst, view[pos : pos + length])
        pos += length
    return 0


class LinkCodec:
    """One end of one link. Create, call `start()` and feed bytes.

    Phases: preface+handshake -> established (records). With `hello` given (a function of
    the handshake hash giving the HELLO body, which signs it), the
    HELLO frame is queued as the first frame once the handshake finishes;
    `on_frame` sees the peer's HELLO like any other frame.
    """

    def __init__(
        self,
        initiator: bool,
        network: str,
        psk: bytes,
        on_frame: FrameHandler,
        rekey_after: int = DEFAULT_REKEY_AFTER,
        hello: HelloBody | None = None,
        static: bytes | None = None,
        caps: int = 0,
    ) -> None:
        self.initiator = initiator
        self.caps = caps  # our AEAD capability bits (noise.CAP_AES), offered in the handshake
        self.suite: Suite = CHACHA20_POLY1305  # the negotiated transport AEAD, once msg2 is done
        self.hello = hello
        self.on_frame = on_frame
        self.rekey_after = rekey_after
        self._hs: HandshakeState | None = HandshakeState(
            NOISE_PATTERN, initiator, prologue(network), s=static or generate_private(), psks=(psk,)
        )
        self.remote_static = b""  # the peer's Noise static key, once the handshake is done
        self.handshake_hash = b""
        self._buf = bytearray()
        self._got_preface = False
        self._out: list[bytes] = []
        self._pending = bytearray()  # plaintext frames waiting to be sealed
        self.send: SendCipher | None = None
        self.recv: RecvCipher | None = None
        # counters the adapter flushes into metrics
        self.records_in = 0
        self.replayed = 0
        self.forged = 0
        self.malformed = 0

    @property
    def established(self) -> bool:
        return self.send is not None

    def start(self) -> None:
        if self.initiator:
            assert self._hs is not None
            self._out.append(PREFACE + self._hs_msg(self._hs.write_message(aead_offer(self.caps))))

    @staticmethod
    def _hs_msg(msg: bytes) -> bytes:
        return len(msg).to_bytes(2, "big") + msg

    def data_to_send(self) -> list[bytes]:
        """Chunks for one writelines(); seals any pending frames first."""
        out = self._out
        pending = self._pending
        if pending:
            assert self.send is not None, "send_frame before the handshake finished"
            out += self.send.seal(pending)  # header, ciphertext (_seal_pending's work, one call less)
            self._pending = bytearray()
        self._out = []
        return out

    # ----------------------------------------------------------------- receive

    def receive(self, data: bytes | bytearray | memoryview) -> None:
        """Consume bytes from the link. Raises LinkError when the link must close."""
        buf = self._buf
        if self._hs is None and not buf:
            # Nothing held back (the usual case once established): open the records
            # straight from `data` and keep only an incomplete tail, instead of first
            # copying every received byte into the buffer (~8% of a portal's CPU in bulk).
            used = self._receive_records(data)
            if used < len(data):
                buf += memoryview(data)[used:]
            return
        buf += data
        if self._hs is not None:
            self._receive_handshake()
            if self._hs is not None:
                return
        self._receive_records(buf)

    def _receive_handshake(self) -> None:
        buf = self._buf
        hs = self._hs
        assert hs is not None
        if not self._got_preface:
            if len(buf) < len(PREFACE):
                if not MAGIC.startswith(bytes(buf[:4])):
                    raise LinkError("bad_magic", "not a meshgate link")
                return
            if buf[:4] != MAGIC:
                raise LinkError("bad_magic", "not a meshgate link")
            if buf[4] != VERSION:
                if not self.initiator:
                    # answer with our own preface, so the older (or newer) peer reports the
                    # versions instead of waiting for a reply that never comes
                    self._out.append(PREFACE)
                raise LinkError("bad_version", f"peer speaks protocol version {buf[4]}, this node {VERSION}")
            del buf[: len(PREFACE)]
            self._got_preface = True
        while self._hs is not None and len(buf) >= 2:
            n = int.from_bytes(buf[:2], "big")
            if len(buf) < 2 + n:
                return
            msg = bytes(buf[2 : 2 + n])
            del buf[: 2 + n]
            try:
                payload = hs.read_message(msg)
                if hs.finished:
                    pass  # msg3 (responder): its payload is empty
                elif self.initiator:  # msg2: the responder's answer (LinkError if against the rule)
                    self.suite = answered_suite(self.caps, payload)
                    self._out.append(self._hs_msg(hs.write_message()))
                else:  # msg1: the initiator's offer
                    self.suite, answer = answer_offer(self.caps, payload)
                    self._out.append(PREFACE + self._hs_msg(hs.write_message(answer)))
            except NoiseError:
                raise LinkError("handshake", "handshake failed") from None
            if hs.finished:
                self._finish_handshake(hs)

    def _finish_handshake(self, hs: HandshakeState) -> None:
        i2r, r2i = hs.split()
        assert i2r.k is not None and r2i.k is not None
        send_key, recv_key = (i2r.k, r2i.k) if self.initiator else (r2i.k, i2r.k)
        self.send = SendCipher(send_key, self.rekey_after, self.suite)
        self.recv = RecvCipher(recv_key, self.suite)
        self.remote_static = hs.rs or b""
        self.handshake_hash = hs.handshake_hash
        self._hs = None
        if self.hello is not None:
            # HELLO is the first sealed frame each side sends, before anything the
            # records that follow in this same read might make us send
            self.send_frame(HELLO, 0, 1, 0, 0, self.hello(self.handshake_hash, self.initiator))

    def _receive_records(self, buf: bytes | bytearray | memoryview) -> int:
        """Open the complete records at the start of `buf` (the held-back buffer or fresh
        bytes); returns the bytes used. Used bytes leave the held-back buffer even when a
        record fails the link."""
        recv = self.recv
        assert recv is not None
        # fresh bytes are immutable: one view of them serves every record. The held-back
        # bytearray grows if a frame handler feeds this codec again, which no view may block
        held = buf is self._buf
        whole = None if held else memoryview(buf)
        pos, end = 0, len(buf)
        unpack, frame_unpack = RECORD.unpack_from, FRAME.unpack_from
        try:
            while end - pos >= RECORD_SIZE:
                length, epoch, counter = unpack(buf, pos)
                if length > MAX_RECORD or length < MIN_RECORD:
                    raise LinkError("bad_length", f"record length {length} out of range")
                total = 4 + length
                if end - pos < total:
                    break
                view = whole if whole is not None else memoryview(buf)
                try:
                    plain = recv.open(
                        view[pos : pos + RECORD_SIZE], epoch, counter, view[pos + RECORD_SIZE : pos + total]
                    )
                finally:
                    if held:
                        view.release()
                pos += total
                if plain is None:
                    if recv.window.highest >= counter and epoch == recv.epoch:
                        self.replayed += 1
                    else:
                        self.forged += 1
                    continue
                self.records_in += 1
                n = len(plain)
                if n >= FRAME_SIZE:
                    ftype, flags, hop, length, src, dst = frame_unpack(plain, 0)
                    if FRAME_SIZE + length == n:
                        # one frame filling the record (a small request, a relayed frame): what
                        # iter_frames would do, without its call and its loop
                        self.on_frame(ftype, flags, hop, src, dst, memoryview(plain)[FRAME_SIZE:])
                        continue
                self.malformed += iter_frames(plain, self.on_frame)
        finally:
            if pos and held:
                del self._buf[:pos]
        return pos

    # ----------------------------------------------------------------- send

    def send_frame(
        self,
        ftype: int,
        flags: int,
        hop: int,
        src: int,
        dst: int,
        head: bytes | bytearray | memoryview,
        data: bytes | bytearray | memoryview = b"",
    ) -> None:
        """Queue one frame whose body is head+data (no concatenation copy); it is
        sealed with the other frames of this batch at `data_to_send()` (one AEAD per batch)."""
        n = len(head) + len(data)
        pending = self._pending
        if len(pending) + n > MAX_PENDING:
            if pending:
                self._seal_pending()
                pending = self._pending
            if n > MAX_BODY:
                raise ValueError(f"frame body of {n} bytes exceeds {MAX_BODY}")
        pending += FRAME.pack(ftype, flags, hop, n, src, dst)
        pending += head
        if data:
            pending += data

    def pending_bytes(self) -> int:
        return len(self._pending)

    def _seal_pending(self) -> None:
        assert self.send is not None, "send_frame before the handshake finished"
        self._out += self.send.seal(self._pending)  # header, ciphertext
        self._pending = bytearray()
