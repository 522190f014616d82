"""SOCKS5 worker processes: `[socks5] workers = N` accepts the portal's connections in N processes.

The node's process binds socks5.listen with SO_REUSEPORT and starts N-1 workers
(`python -m meshgate.gateway.worker FD HANDOVER_FD`) that bind the same address,
so the kernel spreads connections over the processes. A worker does the SOCKS5
handshake itself (socks5.users are in its config), then asks the node's process
where the request's destination goes:

* it leaves from this host (no mesh route, `mesh.direct_fallback`, or a node
  without a mesh): the answer carries the addresses, resolved by the node's own
  dialer (its DNS pipeline, mesh names, egress policy), and the worker connects
  and relays. This is where the CPU of a connection is spent, off the node's
  process;
* anything else (a mesh route, this node's own egress, exits) and every UDP
  ASSOCIATE: the worker hands the connection over. The client's socket goes to
  the node's process over a SOCK_SEQPACKET socketpair (SCM_RIGHTS) with the
  request and the bytes the client sent behind it; that process goes on from the
  request (`Socks5Server.adopt`) exactly as if it had read it.

Asking costs one short round trip on the control socket per connection; it keeps
one routing decision (the node's dialer, with its current routes) instead of a
copy in every worker that could lag behind the mesh. A node without a mesh and
without an egress policy tells its workers so at setup: there an address literal
can only leave from this host, and the worker connects it without asking.

Control frames are those of the DNS workers (meshgate/dns/worker_pool.py:
`length(4) kind(1) payload`, counters merged the same way):

    main -> worker   C  setup (pickle: config, index, loop kind, parent pid), first frame only
                     U  a reload's socks5.users and [limits] (pickle)
                     S  stop
                     A  route answer: u32 id, u8 verdict (LOCAL: addresses, comma-separated;
                        REFUSE: u8 SOCKS reply code; MESH: nothing)
    worker -> main   R  ready (JSON {"pid"})    E  could not start (text)
                     M  counters (JSON, as the DNS workers')
                     Q  route question: u32 id, u16 port, then the host (text)

A hand-over message (worker -> main, with the socket in SCM_RIGHTS):
u8 command, u8 address type, u16 port, u8 address length, address, the trailing
bytes. The worker parses untrusted input, so nothing it sends is unpickled or
trusted beyond these fields: a malformed one closes the socket and is counted.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import dataclasses
import ipaddress
import logging
import os
import pickle
import socket
import struct
from typing import Any

from meshgate import replies
from meshgate.config import Config, DnsConfig, LimitsConfig, MeshConfig, User
from meshgate.egress.dialer import Dialer, DialError
from meshgate.egress.mesh_dialer import MeshDialer
from meshgate.errors import StartupError
from meshgate.gateway import socks5
from meshgate.gateway.server import HANDED_OVER, Socks5Server
from meshgate.logs import RateLimitedLog
from meshgate.policy import in_any
from meshgate.workerproc import (
    READY_TIMEOUT,
    STOP_TIMEOUT,
    CounterMerge,
    WorkerSlot,
    after_exit,
    common_frame,
    frame,
    read_frame,
    spawn,
    stop_workers,
)

log = logging.getLogger("meshgate.gateway.workers")
_rlog = RateLimitedLog(log)

MAX_HANDOVER = 64 * 1024  # request + what the client sent behind it (the worker reads one buffer)

LOCAL, MESH, REFUSE = 0, 1, 2
ID = struct.Struct("!I")
QUESTION = struct.Struct("!IH")  # id, port; then the host
ANSWER = struct.Struct("!IB")  # id, verdict; then the addresses or the reply code
HANDOVER = struct.Struct("!BBHB")  # command, address type, port, address length


def worker_config(config: Config, listen_port: int) -> Config:
    """What a worker needs: the portal's settings on the bound port, its users and limits; no
    mesh, no DNS, no network secret (it asks the node's process where things go)."""
    node = dataclasses.replace(config.node, secret="")
    listen = dataclasses.replace(config.socks5.listen, port=listen_port)
    socks = dataclasses.replace(config.socks5, listen=listen, workers=1)
    return dataclasses.replace(config, node=node, mesh=MeshConfig(), dns=DnsConfig(), socks5=socks)


async def route_for_worker(dialer: Dialer, host: str, port: int) -> tuple[int, bytes]:
    """The node's answer to a worker's question about `host:port`: LOCAL with the addresses to
    connect (what this node's dialer would connect from this host), MESH when this process
    must dial it, REFUSE with the SOCKS reply code it would have sent."""
    try:
        ip: ipaddress.IPv4Address | ipaddress.IPv6Address | None = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    try:
        if isinstance(dialer, MeshDialer):
            if ip is None:
                ip = dialer.mesh_name(host)
            route = dialer.mesh.lookup(ip) if ip is not None else dialer.route_name()
            inside = ip is not None and in_any(ip, dialer.rules.vnets)
            if route is not None or not dialer.direct_fallback or inside:
                return MESH, b""  # routed, or refused by the rules only that dialer applies
        addrs = [ip] if ip is not None else await dialer.resolve(host, port)
    except DialError as e:
        return REFUSE, bytes((e.reply,))
    allowed = [a for a in addrs if dialer.policy is None or dialer.policy(a, port)]
    if not allowed:
        return REFUSE, bytes((replies.NOT_ALLOWED,))
    return LOCAL, ",".join(str(a) for a in allowed).encode()


def encode_handover(request: socks5.Request, trailing: bytes) -> bytes:
    head = HANDOVER.pack(request.command, request.atyp, request.port, len(request.addr))
    return head + request.addr + trailing


def decode_handover(data: bytes) -> tuple[socks5.Request, bytes]:
    """ValueError on anything that is not a request the worker could have parsed."""
    if len(data) < HANDOVER.size:
        raise ValueError("short hand-over")
    cmd, atyp, port, n = HANDOVER.unpack_from(data)
    addr = data[HANDOVER.size : HANDOVER.size + n]
    if len(addr) != n or cmd not in (socks5.CMD_CONNECT, socks5.CMD_UDP_ASSOCIATE):
        raise ValueError("bad hand-over request")
    want = {socks5.ATYP_IPV4: 4, socks5.ATYP_IPV6: 16}.get(atyp)
    if (want is not None and n != want) or (want is None and (atyp != socks5.ATYP_DOMAIN or not n
                                                              or not addr.isascii())):
        raise ValueError("bad hand-over address")
    return socks5.Request(cmd, atyp, addr, port), data[HANDOVER.size + n :]


@dataclasses.dataclass
class _Worker(WorkerSlot):
    handover: socket.socket | None = None  # the node's end of the hand-over socketpair


class SocksWorkerPool:
    """The N-1 extra processes of the SOCKS5 portal: started, answered, fed reloads, restarted."""

    def __init__(self, config: Config, count: int, dialer: Dialer, server: Socks5Server, port: int) -> None:
        self.config = config
        self.dialer = dialer
        self.server = server
        self.port = port
        self.workers = [_Worker(i, CounterMerge(i)) for i in range(1, count)]
        self.stopping = False
        self.started = False
        self._asks: set[asyncio.Task[None]] = set()
        self._adopting: set[asyncio.Task[None]] = set()
        self._loop_kind = "asyncio"

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._loop_kind = "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"
        for w in self.workers:
            await self._spawn(w)
        try:
            async with asyncio.timeout(READY_TIMEOUT):
                await asyncio.gather(*(w.ready for w in self.workers if w.ready is not None))
        except TimeoutError:
            raise StartupError(f"socks5.workers: a worker did not start within {READY_TIMEOUT:.0f}s"
                               ) from None
        self.started = True

    async def _spawn(self, w: _Worker) -> None:
        loop = asyncio.get_running_loop()
        parent, child = socket.socketpair()
        hand_parent, hand_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        w.proc = await spawn("meshgate.gateway.worker", [child, hand_child])
        hand_parent.setblocking(False)
        w.handover = hand_parent
        loop.add_reader(hand_parent.fileno(), self._handed_over, w)
        reader, writer = await asyncio.open_unix_connection(sock=parent)
        w.writer = writer
        w.started_at = loop.time()
        w.ready = loop.create_future() if not self.started else None
        w.merge.restarted()
        # no mesh and no egress policy: address literals leave from this host whatever they are
        direct = not isinstance(self.dialer, MeshDialer) and self.dialer.policy is None
        setup = {"config": worker_config(self.config, self.port), "index": w.index, "loop": self._loop_kind,
                 "parent": os.getpid(), "direct_literals": direct}
        writer.write(frame(b"C", pickle.dumps(setup)))
        w.task = loop.create_task(self._run(w, reader))

    def _handed_over(self, w: _Worker) -> None:
        sock = w.handover
        assert sock is not None
        for _ in range(64):  # a burst per wake-up, then the loop's other work
            fds = array.array("i")
            try:
                data, anc, _flags, _ = sock.recvmsg(MAX_HANDOVER, socket.CMSG_SPACE(fds.itemsize))
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            for level, kind, raw in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.frombytes(raw[: len(raw) - len(raw) % fds.itemsize])
            if not data and not fds:
                # the worker is gone (EOF): stop watching; _run restarts it
                asyncio.get_running_loop().remove_reader(sock.fileno())
                return
            client = socket.socket(fileno=fds[0]) if fds else None
            for extra in fds[1:]:
                os.close(extra)  # one socket per message: a worker sends no more
            try:
                if client is None:
                    raise ValueError("no socket in the hand-over")
                request, trailing = decode_handover(data)
            except ValueError as e:
                HANDED_OVER.labels("malformed").inc()
                _rlog.debug("handover", "socks5 worker %d: %s: dropped", w.index, e)
                if client is not None:
                    client.close()
                continue
            client.setblocking(False)
            task = asyncio.get_running_loop().create_task(self._adopt(client, request, trailing))
            self._adopting.add(task)
            task.add_done_callback(self._adopting.discard)

    async def _adopt(self, client: socket.socket, request: socks5.Request, trailing: bytes) -> None:
        try:
            await self.server.adopt(client, request, trailing)
        except OSError as e:  # the client went away in between
            _rlog.debug("adopt", "socks5: handed-over connection lost: %s", e)
            client.close()

    async def _run(self, w: _Worker, reader: asyncio.StreamReader) -> None:
        while True:
            got = await read_frame(reader)
            if got is None:
                break
            kind, payload = got
            if not common_frame(w, kind, payload) and kind == b"Q":
                self._ask(w, payload)
        self._close_channels(w)
        await after_exit(w, "socks5", self.started, lambda: self.stopping, self._spawn)

    def _close_channels(self, w: _Worker) -> None:
        if w.writer is not None:
            w.writer.close()
            w.writer = None
        if w.handover is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(w.handover.fileno())
            w.handover.close()
            w.handover = None

    def _ask(self, w: _Worker, payload: bytes) -> None:
        if len(payload) < QUESTION.size:
            return
        if len(self._asks) >= self.config.socks5.max_clients * len(self.workers):
            # more questions open than the workers may hold clients: refuse at once (bounded)
            HANDED_OVER.labels("questions_refused").inc()
            if w.writer is not None and not w.writer.is_closing():
                qid = ID.unpack_from(payload)[0]
                w.writer.write(frame(b"A", ANSWER.pack(qid, REFUSE) + bytes((replies.GENERAL_FAILURE,))))
            return
        task = asyncio.get_running_loop().create_task(self._answer(w, payload))
        self._asks.add(task)
        task.add_done_callback(self._asks.discard)

    async def _answer(self, w: _Worker, payload: bytes) -> None:
        qid, port = QUESTION.unpack_from(payload)
        host = payload[QUESTION.size :].decode("ascii", "replace")
        try:
            verdict, rest = await route_for_worker(self.dialer, host, port)
        except Exception as e:  # never let one question take the control channel down
            log.debug("socks5 worker %d: route question failed: %r", w.index, e)
            verdict, rest = REFUSE, bytes((replies.GENERAL_FAILURE,))
        if w.writer is not None and not w.writer.is_closing():
            w.writer.write(frame(b"A", ANSWER.pack(qid, verdict) + rest))

    def push(self, users: tuple[User, ...], limits: LimitsConfig) -> None:
        """A reload's socks5.users and [limits]: workers check new connections against them."""
        socks = dataclasses.replace(self.config.socks5, users=users)
        self.config = dataclasses.replace(self.config, socks5=socks, limits=limits)
        payload = pickle.dumps((users, limits))
        for w in self.workers:
            if w.writer is not None and not w.writer.is_closing():
                w.writer.write(frame(b"U", payload))

    async def stop(self) -> None:
        self.stopping = True
        for t in [*self._asks, *self._adopting]:
            t.cancel()
        await stop_workers(self.workers, "socks5", STOP_TIMEOUT)
        for w in self.workers:
            self._close_channels(w)

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self.workers if w.proc is not None and w.proc.returncode is None]

    def status(self) -> dict[str, Any]:
        return {str(w.index): {"pid": w.proc.pid if w.proc else None, "restarts": w.restarts}
                for w in self.workers}
