"""Sans-I/O NAT traversal: endpoint lists, probe packets, and each node pair's punching state.

Three pieces, no sockets and no clock (callers pass `now`):

- **Probes** (`seal_probe` / `open_probe`): the small authenticated packets a node sends from
  its traversal socket (a udp:// listener) to another node's candidate endpoints, and to a
  udp:// neighbour's listener to learn its own reflexive endpoint. A PING names its sender
  and receiver; the receiver answers a PONG carrying the address the PING came from. Sealed
  with ChaCha20-Poly1305 under a key both ends derive from their persistent X25519 node keys
  (static-static DH, as Tailscale's disco does with its own keys): only the two nodes can
  make or read one, the receiver id inside stops a probe meant for one node being answered by
  another, and a time stamp plus a bounded table of seen nonces stops replays.

      probe = KIND_PROBE u8 | MAGIC (4) | sender id u32 | nonce (12) | AEAD(body, ad = first 21 bytes)
      body  = type u8 (1 ping, 2 pong) | tx id (8) | time ms u64 | receiver id u32 | endpoint?

- **Calls** (`encode_call` / `decode_call`): the body of a TRAVERSAL frame, sent over the mesh
  end to end (sealed by the node pair's e2e session, so a relay can neither read nor forge
  it): "here are my endpoints; probe me now". The answer is a call back; both ends then probe
  at once. The call's arrival is the agreed moment: both start within one relayed trip.

      call     = version u8 | flags u8 (1: answer me) | endpoint count u8 | endpoint*
      endpoint = kind u8 (1 local, 2 reflexive) | family u8 (4, 6) | address (4 or 16) | port u16

- **Pairs** (`Pair`): the state of punching towards one node: its candidates, probes in
  flight, the per-minute probe budget, the back-off after failed attempts.

Which side dials once a probe was answered: the lower node id (both would otherwise make a
link each). The higher waits a moment and dials only if no link came.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import struct
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from meshgate.mesh.frames import MAGIC
from meshgate.mesh.noise import dh, hkdf

KIND_PROBE = 0x20  # first byte of a probe: not one of the udp session's kinds (1-4)
PING = 1
PONG = 2
LOCAL = 1
REFLEXIVE = 2
KIND_NAMES = {LOCAL: "local", REFLEXIVE: "reflexive"}
CALL_VERSION = 1
CALL_ANSWER = 0x01  # flag: the receiver calls back with its own endpoints

HEAD = struct.Struct("!B4sI12s")  # kind, magic, sender id, nonce
BODY = struct.Struct("!B8sQI")  # type, tx id, time ms, receiver id
EP_HEAD = struct.Struct("!BB")  # endpoint kind, family
CALL_HEAD = struct.Struct("!BBB")
TAG = 16
PROBE_MIN = HEAD.size + BODY.size + TAG
MAX_ENDPOINTS = 8  # per call: a node has a few interfaces and one reflexive address per NAT
MAX_AGE_MS = 30_000  # a probe older (or newer) than this is refused: clocks differ a little
SEEN_NONCES = 4096  # replay table, whole process

Endpoint = tuple[str, int]  # host, port
Addr = tuple[str, int]


class TraversalError(ValueError):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason  # a counter label


@dataclass(frozen=True)
class Probe:
    sender: int
    ptype: int
    tx: bytes
    time_ms: int
    receiver: int
    observed: Endpoint | None  # a PONG: where the PING came from


def probe_key(own_dh_private: bytes, peer_dh_public: bytes, network: str) -> bytes:
    """The key of one node pair's probes (the same on both ends): HKDF of their static DH,
    salted with the network name so two networks' probes never open each other's."""
    salt = hashlib.sha256(b"meshgate probe|" + network.encode()).digest()
    k, _ = hkdf(salt, dh(own_dh_private, peer_dh_public), 2)
    return k


def _pack_endpoint(kind: int, ep: Endpoint) -> bytes:
    ip = ipaddress.ip_address(ep[0])
    return EP_HEAD.pack(kind, ip.version) + ip.packed + struct.pack("!H", ep[1])


def _unpack_endpoint(data: memoryview | bytes, off: int) -> tuple[int, Endpoint, int]:
    if len(data) < off + EP_HEAD.size:
        raise TraversalError("malformed")
    kind, family = EP_HEAD.unpack_from(data, off)
    off += EP_HEAD.size
    size = 4 if family == 4 else 16 if family == 6 else 0
    if not size or len(data) < off + size + 2:
        raise TraversalError("malformed")
    ip = ipaddress.ip_address(bytes(data[off : off + size]))
    off += size
    port = struct.unpack_from("!H", data, off)[0]
    if port == 0 or kind not in KIND_NAMES:
        raise TraversalError("malformed")
    return kind, (str(ip), port), off + 2


def seal_probe(
    aead: ChaCha20Poly1305, sender: int, ptype: int, tx: bytes, time_ms: int, receiver: int,
    observed: Endpoint | None = None,
) -> bytes:
    head = HEAD.pack(KIND_PROBE, MAGIC, sender, os.urandom(12))
    body = BODY.pack(ptype, tx, time_ms, receiver)
    if observed is not None:
        body += _pack_endpoint(REFLEXIVE, observed)
    return head + aead.encrypt(head[-12:], body, head)


def probe_sender(packet: bytes | memoryview) -> int:
    """The claimed sender of a probe (which key to open it with); raises if it is none."""
    if len(packet) < PROBE_MIN or packet[0] != KIND_PROBE or bytes(packet[1:5]) != MAGIC:
        raise TraversalError("malformed")
    return int(HEAD.unpack_from(packet)[2])


class Replays:
    """Nonces of probes already taken (bounded, oldest out): a probe seen twice is refused."""

    def __init__(self, size: int = SEEN_NONCES) -> None:
        self.size = size
        self._seen: OrderedDict[bytes, None] = OrderedDict()

    def check(self, nonce: bytes) -> bool:
        if nonce in self._seen:
            return False
        self._seen[nonce] = None
        if len(self._seen) > self.size:
            self._seen.popitem(last=False)
        return True


def open_probe(
    aead: ChaCha20Poly1305, packet: bytes | memoryview, own_id: int, now_ms: int, replays: Replays
) -> Probe:
    """Authenticate and parse a probe for this node; TraversalError(reason) otherwise."""
    probe_sender(packet)  # the shape (length, kind, magic) first
    head = bytes(packet[: HEAD.size])
    sender = HEAD.unpack(head)[2]
    try:
        body = aead.decrypt(head[-12:], bytes(packet[HEAD.size :]), head)
    except InvalidTag:
        raise TraversalError("bad_seal") from None
    if len(body) < BODY.size:
        raise TraversalError("malformed")
    ptype, tx, time_ms, receiver = BODY.unpack_from(body)
    if receiver != own_id:
        raise TraversalError("wrong_receiver")
    if abs(now_ms - time_ms) > MAX_AGE_MS:
        raise TraversalError("stale")
    if not replays.check(head[-12:]):
        raise TraversalError("replayed")
    observed = None
    if ptype == PONG:
        if len(body) == BODY.size:
            raise TraversalError("malformed")
        _kind, observed, end = _unpack_endpoint(body, BODY.size)
        if end != len(body):
            raise TraversalError("malformed")
    elif ptype != PING or len(body) != BODY.size:
        raise TraversalError("malformed")
    return Probe(sender, ptype, tx, time_ms, receiver, observed)


def encode_call(endpoints: Iterable[tuple[int, Endpoint]], answer: bool) -> bytes:
    eps = list(endpoints)[:MAX_ENDPOINTS]
    return CALL_HEAD.pack(CALL_VERSION, CALL_ANSWER if answer else 0, len(eps)) + b"".join(
        _pack_endpoint(kind, ep) for kind, ep in eps
    )


def decode_call(body: memoryview | bytes) -> tuple[list[tuple[int, Endpoint]], bool]:
    if len(body) < CALL_HEAD.size:
        raise TraversalError("malformed")
    version, flags, count = CALL_HEAD.unpack_from(body)
    if version != CALL_VERSION or count > MAX_ENDPOINTS:
        raise TraversalError("malformed")
    off = CALL_HEAD.size
    out = []
    for _ in range(count):
        kind, ep, off = _unpack_endpoint(body, off)
        out.append((kind, ep))
    if off != len(body):
        raise TraversalError("malformed")
    return out, bool(flags & CALL_ANSWER)


# ---------------------------------------------------------------------- one pair

# seconds after the call when each round of probes goes to every candidate: dense at first
# (most NAT pairs answer within the first rounds), then thinning out
PROBE_ROUNDS = (0.0, 0.1, 0.25, 0.5, 0.8, 1.2, 1.7, 2.3, 3.0)
ATTEMPT_LENGTH = 4.0  # an attempt with no link by then failed
BACKOFF_FIRST = 5.0


@dataclass
class Pair:
    """Punching towards one node."""

    peer: int
    candidates: dict[Endpoint, int] = field(default_factory=dict)  # endpoint -> kind
    tx: dict[bytes, tuple[Endpoint, float]] = field(default_factory=dict)  # probe in flight
    sent: deque[float] = field(default_factory=deque)  # times of probes sent (budget window)
    started: float = -1.0  # the current attempt's start (-1: none running)
    next_round: int = 0
    failures: int = 0
    not_before: float = 0.0  # back-off: no new attempt before this
    answered: Endpoint | None = None  # a probe to it was answered in this attempt
    answered_kind: int = 0
    answered_at: float = 0.0
    dialed: bool = False
    heard: bool = False  # a probe from the peer arrived in this attempt

    def budget(self, now: float, per_minute: int) -> int:
        """Probes this pair may still send in the minute before `now`."""
        sent = self.sent
        while sent and now - sent[0] >= 60.0:
            sent.popleft()
        return max(0, per_minute - len(sent))

    def spend(self, now: float) -> None:
        self.sent.append(now)

    def can_start(self, now: float) -> bool:
        return self.started < 0 and now >= self.not_before

    def start(self, now: float) -> None:
        """A new attempt: what the last one learned is forgotten."""
        self.candidates.clear()
        self.rounds_from(now)
        self.answered = None
        self.answered_kind = 0
        self.dialed = False
        self.heard = False
        self.tx.clear()

    def rounds_from(self, now: float) -> None:
        """Probe rounds from `now` (the moment the peer's endpoints arrived)."""
        self.started = now
        self.next_round = 0

    def due_rounds(self, now: float) -> int:
        """How many probe rounds are due at `now` (each sends to every candidate)."""
        if self.started < 0:
            return 0
        n = 0
        while self.next_round < len(PROBE_ROUNDS) and now >= self.started + PROBE_ROUNDS[self.next_round]:
            self.next_round += 1
            n += 1
        return n

    def next_deadline(self) -> float | None:
        if self.started < 0:
            return None
        if self.next_round < len(PROBE_ROUNDS):
            return self.started + PROBE_ROUNDS[self.next_round]
        return self.started + ATTEMPT_LENGTH

    def expired(self, now: float) -> bool:
        return self.started >= 0 and now >= self.started + ATTEMPT_LENGTH

    def succeeded(self) -> None:
        self.started = -1.0
        self.failures = 0
        self.not_before = 0.0
        self.tx.clear()

    def failed(self, now: float, backoff_max: float) -> None:
        """The attempt ended with no link: wait longer before the next (doubling, capped)."""
        self.started = -1.0
        self.failures += 1
        self.not_before = now + min(backoff_max, BACKOFF_FIRST * 2 ** (self.failures - 1))
        self.tx.clear()

    def learn(self, endpoints: Iterable[tuple[int, Endpoint]], limit: int = MAX_ENDPOINTS) -> None:
        for kind, ep in endpoints:
            if ep in self.candidates or len(self.candidates) < limit * 2:
                self.candidates[ep] = kind


@dataclass
class Pairs:
    """Every pair this node punches with, bounded (least recently used evicted)."""

    size: int
    table: OrderedDict[int, Pair] = field(default_factory=OrderedDict)

    def get(self, peer: int, create: bool = True) -> Pair | None:
        pair = self.table.get(peer)
        if pair is not None:
            self.table.move_to_end(peer)
            return pair
        if not create:
            return None
        pair = Pair(peer)
        self.table[peer] = pair
        if len(self.table) > self.size:
            self.table.popitem(last=False)
        return pair
