"""Sans-I/O end-to-end sessions: traffic sealed between the two nodes that terminate it.

Links are sealed hop by hop; a relay opens each link record and would see the frames it
forwards. Between the source and the destination of relayed traffic this layer runs its
own Noise handshake, `Noise_IK_25519_ChaChaPoly_SHA256` with the nodes' persistent static
keys (identity.py): the initiator knows the responder's key from its signed route record,
the responder learns the initiator's from message 1 and checks it owns the frame's source
id (and, in certificate mode, its certificate). Stream frames and datagrams are then sealed
with that session's keys (frames.SendCipher / RecvCipher: explicit counters, a replay
window, REKEY every `rekey_after` records), so a relay can neither read, change, replay nor
forge them; it sees sizes and timing (docs/PROTOCOL.md section 11).

One session per node pair and process start (both ends' sessions), set up by whichever
sends first; bounded (`max_sessions`, least recently used evicted) with a bounded queue of
frames waiting for the handshake. Where the next hop is the destination itself the frame
goes unsealed: the link is already sealed between exactly those two nodes and its peer was
authenticated by its HELLO, so sealing again would buy nothing (measured in bench/mesh.py).

No sockets, no clock: callers pass `now`.
"""

from __future__ import annotations

import collections
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

from meshgate.mesh.frames import (
    DATAGRAM,
    DATAGRAM_SEALED,
    E2E_INIT,
    FLAG_AES,
    RECORD,
    SEALED,
    TAG,
    VERSION,
    RecvCipher,
    SendCipher,
)
from meshgate.mesh.identity import Identity, node_id_of
from meshgate.mesh.noise import CAP_AES, CHACHA20_POLY1305, HandshakeState, NoiseError, Suite, choose_suite

PATTERN = "IK"
PROLOGUE = b"meshgate e2e|" + bytes((VERSION,)) + b"|"
INDEX = struct.Struct("!I")
RESP_HEAD = struct.Struct("!II")  # initiator's index, responder's index
INNER = struct.Struct("!BB")  # sealed stream frame: inner type, inner flags
# what sealing adds to a frame body: receiver index, record header, tag (and the inner type and
# flags of a stream frame)
SEAL_OVERHEAD = INDEX.size + RECORD.size + TAG + INNER.size
HANDSHAKE_RESEND = 1.0  # seconds before message 1 goes again (lost, or no route yet)
HANDSHAKE_GIVE_UP = 10.0  # and before the queued frames are dropped
# The AEAD negotiation (docs/PROTOCOL.md section 11): message 1 must stay what responders from
# before it accept, so the initiator's offer is the E2E_INIT frame's FLAG_AES bit (they ignore
# it); a new responder always answers in message 2's payload (OFFER_V1, the suite it chose, its
# capability bits, the bits it saw offered), sealed under both ends' keys, and the initiator
# refuses an answer whose echo is not what it offered (a relay cleared or set the bit) or
# whose suite the rule does not give. Old responders answer an empty payload: ChaCha20-Poly1305.
OFFER_V1 = 0x01
ANSWER = struct.Struct("!BBBB")  # OFFER_V1, chosen suite, responder's bits, offered bits seen
# Which process of a node a session is with (docs/PROTOCOL.md section 11): message 1 ends with
# the initiator's session and start version (its route record's first version) when the
# responder's record says it reads them, and message 2's answer ends with the responder's when
# message 1 had them (so neither reaches a node from before this). A node hearing of a peer's new
# process ends what it held with the old one at once, and keeps what it sets up with the new one
# even if the peer's new record is still on its way.
PROCESS = struct.Struct("!IQ")  # session, start version


class E2eError(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason  # a counter label


# (frame type, flags, body) queued for a peer while its session is set up
Queued = tuple[int, int, bytes]
# checks the initiator's public key (and certificate) for its claimed node id: None or a reason
PeerCheck = Callable[[int, bytes, bytes], str | None]
# (peer, its session, its start version): False if that process is older than one already heard of
ProcessCheck = Callable[[int, int, int], bool]


@dataclass
class Session:
    peer: int
    index: int  # ours: the peer puts it in front of what it seals for us
    initiator: bool
    hs: HandshakeState | None = None
    msg1: bytes = b""  # initiator: the message 1 to resend; responder: the one answered
    msg2: bytes = b""  # responder: the answer, resent when message 1 comes again
    peer_index: int = 0
    send: SendCipher | None = None
    recv: RecvCipher | None = None
    suite: Suite = CHACHA20_POLY1305  # the negotiated AEAD, once established
    process: tuple[int, int] | None = None  # the peer's (session, start version), if it said
    told: bool = False  # initiator: message 1 carried our process
    queue: collections.deque[Queued] = field(default_factory=collections.deque)
    queued_bytes: int = 0
    started: float = 0.0
    sent_init: float = 0.0

    @property
    def established(self) -> bool:
        return self.send is not None


class E2e:
    """Every end-to-end session of one node."""

    def __init__(
        self, identity: Identity, network: str, cert: bytes, check_peer: PeerCheck,
        max_sessions: int = 1024, queue_bytes: int = 1 << 20, rekey_after: int = 1 << 30, caps: int = 0,
        process: tuple[int, int] | None = None, check_process: ProcessCheck | None = None,
    ) -> None:
        self.identity = identity
        # our (session, start version), told to peers that read it; None: told to none
        self.process = PROCESS.pack(*process) if process is not None else b""
        self.check_process = check_process
        self.caps = caps  # our AEAD capability bits (noise.CAP_AES)
        # the flags an E2E_INIT frame carries: the initiator's offer
        self.init_flags = FLAG_AES if caps & CAP_AES else 0
        self.prologue = PROLOGUE + network.encode()
        self.cert = cert
        self.check_peer = check_peer
        self.max_sessions = max_sessions
        self.queue_bytes = queue_bytes
        self.rekey_after = rekey_after
        # peer -> session, least recently used first
        self.sessions: collections.OrderedDict[int, Session] = collections.OrderedDict()
        self.by_index: dict[int, Session] = {}
        self.counts: collections.Counter[str] = collections.Counter()

    # ------------------------------------------------------------------ sessions

    def _new_index(self) -> int:
        while True:
            i = int.from_bytes(os.urandom(4), "big")
            if i and i not in self.by_index:
                return i

    def _add(self, s: Session) -> None:
        old = self.sessions.pop(s.peer, None)
        if old is not None:
            self.by_index.pop(old.index, None)
        while len(self.sessions) >= self.max_sessions:
            _, evicted = self.sessions.popitem(last=False)
            self.by_index.pop(evicted.index, None)
            self.counts["evicted"] += 1
        self.sessions[s.peer] = s
        self.by_index[s.index] = s

    def drop(self, peer: int) -> None:
        """Forget the session with `peer` (it restarted, or became unreachable)."""
        s = self.sessions.pop(peer, None)
        if s is not None:
            self.by_index.pop(s.index, None)

    def _touch(self, s: Session) -> None:
        self.sessions.move_to_end(s.peer)

    # ------------------------------------------------------------------ sending

    def seal(
        self, peer: int, peer_static: bytes, ftype: int, flags: int, body: bytes, now: float, datagram: bool,
        tell: bool = False,
    ) -> tuple[list[tuple[int, bytes]], bool]:
        """What to send to `peer` for one frame: ([(outer type, body), ...], queued?). With no
        session yet the frame waits (bounded) and an E2E_INIT goes instead (telling our process
        if `tell`: the peer's record says it reads it); a datagram that does not fit the queue is
        dropped (counted), a stream frame never is until the session fails."""
        s = self.sessions.get(peer)
        out: list[tuple[int, bytes]] = []
        if s is None:
            s = self._initiate(peer, peer_static, now, tell)
            out.append((E2E_INIT, self._init_body(s)))
        if not s.established:
            if datagram and s.queued_bytes + len(body) > self.queue_bytes:
                self.counts["queue_full"] += 1
                return out, False
            s.queue.append((ftype, flags, body))
            s.queued_bytes += len(body)
            if not out and s.initiator and now - s.sent_init >= HANDSHAKE_RESEND:
                if now - s.started >= HANDSHAKE_GIVE_UP:
                    self.counts["handshake_timeout"] += len(s.queue)
                    self.drop(peer)
                    return out, False
                s.sent_init = now
                out.append((E2E_INIT, self._init_body(s)))
            return out, True
        self._touch(s)
        out.append(self._sealed(s, ftype, flags, body, datagram))
        return out, False

    def seal_now(
        self, peer: int, ftype: int, flags: int, head: bytes | bytearray | memoryview,
        data: bytes | bytearray | memoryview,
    ) -> tuple[bytes, bytes] | None:
        """A stream frame (body `head` + `data`) sealed for `peer` when its session is up, as the
        SEALED body's two parts (index and record header, ciphertext: sent as they are, not joined
        first), or None: `seal` then (no session yet, the frame waits). The bytes are `seal`'s."""
        s = self.sessions.get(peer)
        if s is None or s.send is None:
            return None
        self.sessions.move_to_end(peer)
        header, ct = s.send.seal(b"".join((INNER.pack(ftype, flags), head, data)))
        return INDEX.pack(s.peer_index) + header, ct

    def _sealed(self, s: Session, ftype: int, flags: int, body: bytes, datagram: bool) -> tuple[int, bytes]:
        assert s.send is not None
        plain = body if datagram else INNER.pack(ftype, flags) + body
        header, ct = s.send.seal(plain)
        return (DATAGRAM_SEALED if datagram else SEALED), INDEX.pack(s.peer_index) + header + ct

    def _initiate(self, peer: int, peer_static: bytes, now: float, tell: bool = False) -> Session:
        s = Session(peer, self._new_index(), True, started=now, sent_init=now)
        s.hs = HandshakeState(PATTERN, True, self.prologue, s=self.identity.dh_private, rs=peer_static)
        # message 1 carries what the responder needs to know who we are: the signing half of
        # our public key (the Noise half is in the message) and our certificate; and which
        # process of ours this is, to a responder that reads it
        s.told = tell and bool(self.process)
        payload = (self.identity.signing_public + len(self.cert).to_bytes(2, "big") + self.cert
                   + (self.process if s.told else b""))
        s.msg1 = s.hs.write_message(payload)
        self._add(s)
        self.counts["initiated"] += 1
        return s

    def _init_body(self, s: Session) -> bytes:
        return INDEX.pack(s.index) + s.msg1

    # ------------------------------------------------------------------ receiving

    def on_init(
        self, src: int, body: bytes, now: float, flags: int = 0
    ) -> tuple[bytes | None, list[tuple[int, bytes]]]:
        """Message 1 from `src` in an E2E_INIT frame with `flags` (the offer): (our E2E_RESP body
        or None, frames now sealed for `src`). Raises E2eError(reason) when it must be dropped
        (counted by the caller)."""
        if len(body) < INDEX.size:
            raise E2eError("malformed")
        peer_index = INDEX.unpack_from(body)[0]
        msg1 = bytes(body[INDEX.size:])
        mine = self.sessions.get(src)
        if mine is not None and not mine.initiator and mine.msg1 == msg1:
            return self._resp_body(mine), []  # message 1 again: our answer was lost
        if mine is not None and mine.initiator and not mine.established and self.identity.node_id < src:
            # both sides began at once: the lower id's handshake goes on, the other is dropped
            self.counts["crossed"] += 1
            return None, []
        hs = HandshakeState(PATTERN, False, self.prologue, s=self.identity.dh_private)
        try:
            payload = hs.read_message(msg1)
        except NoiseError:
            raise E2eError("handshake") from None
        if len(payload) < 34:
            raise E2eError("malformed")
        public = payload[:32] + (hs.rs or b"")
        clen = int.from_bytes(payload[32:34], "big")
        cert = payload[34:34 + clen]
        process: tuple[int, int] | None = None
        if len(payload) == 34 + clen + PROCESS.size:
            process = PROCESS.unpack_from(payload, 34 + clen)
        elif len(payload) != 34 + clen:
            raise E2eError("malformed")
        if node_id_of(public) != src:
            raise E2eError("bad_node_id")  # the key does not own the source id it came from
        reason = self.check_peer(src, public, cert)
        if reason is not None:
            raise E2eError(reason)
        if process is not None and self.check_process is not None and not self.check_process(src, *process):
            # a process of src older than one we heard of (its message 1 came late): answering
            # would replace a session with the newer one by a session with one that is gone
            raise E2eError("old_process")
        s = Session(src, self._new_index(), False, msg1=msg1, peer_index=peer_index, started=now)
        s.process = process
        offered = CAP_AES if flags & FLAG_AES else 0
        s.suite = choose_suite(self.caps, offered)
        answer = ANSWER.pack(OFFER_V1, s.suite.code, self.caps, offered)
        if process is not None:
            answer += self.process  # the initiator reads it (it told us its own)
        try:
            s.msg2 = hs.write_message(answer)
        except NoiseError:
            raise E2eError("handshake") from None
        i2r, r2i = hs.split()
        assert i2r.k is not None and r2i.k is not None
        s.send, s.recv = SendCipher(r2i.k, self.rekey_after, s.suite), RecvCipher(i2r.k, s.suite)
        queued: collections.deque[Queued] = mine.queue if mine is not None else collections.deque()
        self._add(s)
        self.counts["responded"] += 1
        return self._resp_body(s), [self._sealed(s, t, f, b, t == DATAGRAM) for t, f, b in queued]

    def _resp_body(self, s: Session) -> bytes:
        return RESP_HEAD.pack(s.peer_index, s.index) + s.msg2

    def on_resp(self, src: int, body: bytes) -> list[tuple[int, bytes]]:
        """Message 2: the session is up; returns the queued frames, sealed. E2eError to drop."""
        if len(body) < RESP_HEAD.size:
            raise E2eError("malformed")
        my_index, peer_index = RESP_HEAD.unpack_from(body)
        s = self.by_index.get(my_index)
        if s is None or s.peer != src or not s.initiator or s.hs is None:
            raise E2eError("unknown_session")
        try:
            answer = s.hs.read_message(bytes(body[RESP_HEAD.size:]))
        except NoiseError:
            raise E2eError("handshake") from None
        if s.told and len(answer) == ANSWER.size + PROCESS.size:
            s.process = PROCESS.unpack_from(answer, ANSWER.size)
            answer = answer[:ANSWER.size]
        suite = self._answered_suite(answer)
        if suite is None:
            s.hs = None  # refused: later copies of this message 2 are unknown_session
            raise E2eError("bad_aead")
        s.suite = suite
        i2r, r2i = s.hs.split()
        assert i2r.k is not None and r2i.k is not None
        s.send, s.recv = SendCipher(i2r.k, self.rekey_after, s.suite), RecvCipher(r2i.k, s.suite)
        s.hs, s.peer_index = None, peer_index
        queued, s.queue, s.queued_bytes = s.queue, collections.deque(), 0
        self.counts["established"] += 1
        return [self._sealed(s, t, f, b, t == DATAGRAM) for t, f, b in queued]

    def _answered_suite(self, answer: bytes) -> Suite | None:
        """The suite of message 2's answer, or None when it must be refused: it does not echo
        our offer (changed on the way: a downgrade attempt) or names what the rule does not give."""
        if not answer:
            return CHACHA20_POLY1305  # a responder from before the negotiation
        if len(answer) != ANSWER.size:
            return None
        marker, code, theirs, seen = ANSWER.unpack(answer)
        expected = choose_suite(self.caps, theirs)
        if marker != OFFER_V1 or seen != self.caps & CAP_AES or code != expected.code:
            return None
        return expected

    def open(self, src: int, body: memoryview, datagram: bool) -> tuple[int, int, memoryview]:
        """A sealed frame from `src`: (inner type, inner flags, inner body, a view of the opened
        plaintext: not copied again). E2eError to drop."""
        if len(body) < INDEX.size + RECORD.size + TAG:
            raise E2eError("malformed")
        s = self.by_index.get(INDEX.unpack_from(body)[0])
        if s is None or s.peer != src or s.recv is None:
            raise E2eError("unknown_session")
        _, epoch, counter = RECORD.unpack_from(body, INDEX.size)
        hstart = INDEX.size
        plain = s.recv.open(body[hstart:hstart + RECORD.size], epoch, counter, body[hstart + RECORD.size:])
        if plain is None:
            raise E2eError("forged_or_replayed")
        self.sessions.move_to_end(src)  # _touch, inline: once per frame received
        if datagram:
            return DATAGRAM, 0, memoryview(plain)
        if len(plain) < INNER.size:
            raise E2eError("malformed")
        ftype, flags = INNER.unpack_from(plain)
        return ftype, flags, memoryview(plain)[INNER.size:]
