"""A SOCKS5 worker process: `python -m meshgate.gateway.worker FD HANDOVER_FD`, started by the
node's SocksWorkerPool.

What the processes say to each other, and why, is in meshgate/gateway/workers.py. This is the
worker's side: read the setup frame, listen on socks5.listen with SO_REUSEPORT, do the SOCKS5
handshake, ask the node's process where each request goes (`WorkerDialer`), relay what leaves
from this host, hand the rest over, report counters, and stop when told to or when the node's
process goes away.
"""

from __future__ import annotations

import array
import asyncio
import contextvars
import ipaddress
import json
import os
import pickle
import signal
import socket
import sys
from collections.abc import Callable
from typing import Any

from meshgate import logs, replies
from meshgate.buffers import BufferPool
from meshgate.config import Config
from meshgate.egress.dialer import Dialer, DialError, IPAddress, _is_ip_literal
from meshgate.errors import StartupError
from meshgate.gateway import socks5
from meshgate.gateway.server import ClientProtocol, HandOver, Socks5Server
from meshgate.gateway.workers import ANSWER, LOCAL, MAX_HANDOVER, MESH, QUESTION, REFUSE, encode_handover
from meshgate.loop import new_loop
from meshgate.metrics import REGISTRY
from meshgate.workerproc import final_report, frame, read_frame, read_setup, report_counters

_ROUTED = REGISTRY.counter(
    "meshgate_socks5_worker_requests_total",
    "CONNECTs a SOCKS5 worker process asked the node's process about, by worker and answer "
    "(local: relayed by the worker; mesh: handed over; refused)", ("worker", "answer"),
)
_ANSWER_NAMES = {LOCAL: "local", MESH: "mesh", REFUSE: "refused"}

# the addresses the node's process answered for the connection being dialed (one per task)
_ANSWERED: contextvars.ContextVar[list[IPAddress]] = contextvars.ContextVar("answered")


class ParentRoutes:
    """Questions to the node's process: where does host:port go? Bounded by max_inflight."""

    def __init__(self, writer: asyncio.StreamWriter, max_inflight: int) -> None:
        self.writer = writer
        self.max_inflight = max_inflight
        self._next = 0
        self._waiting: dict[int, asyncio.Future[tuple[int, bytes]]] = {}

    async def ask(self, host: str, port: int) -> tuple[int, bytes]:
        if len(self._waiting) >= self.max_inflight or self.writer.is_closing():
            raise DialError(replies.GENERAL_FAILURE, "the node's process is not reachable or busy")
        self._next = (self._next + 1) & 0xFFFFFFFF
        qid = self._next
        fut: asyncio.Future[tuple[int, bytes]] = asyncio.get_running_loop().create_future()
        self._waiting[qid] = fut
        try:
            self.writer.write(frame(b"Q", QUESTION.pack(qid, port) + host.encode("ascii", "replace")))
            return await fut  # the connect timeout (the client's timer, or Dialer.connect) bounds the wait
        finally:
            self._waiting.pop(qid, None)

    def answered(self, payload: bytes) -> None:
        if len(payload) < ANSWER.size:
            return
        qid, verdict = ANSWER.unpack_from(payload)
        fut = self._waiting.get(qid)
        if fut is not None and not fut.done():
            fut.set_result((verdict, payload[ANSWER.size :]))

    def close(self) -> None:
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(DialError(replies.GENERAL_FAILURE, "worker stopping"))


class WorkerDialer(Dialer):
    """Connects what the node's process says leaves from this host, to the addresses it gave;
    raises HandOver for the rest."""

    def __init__(self, routes: ParentRoutes, index: int, direct_literals: bool = False, **kw: Any) -> None:
        super().__init__(**kw)
        self.routes = routes
        # the node has no mesh and no egress policy: an address literal can only leave from this
        # host, so the worker connects it without asking (names are still resolved by the node)
        self.direct_literals = direct_literals
        self.counted = {v: _ROUTED.labels(str(index), name) for v, name in _ANSWER_NAMES.items()}

    async def dial(
        self, host: str, port: int, protocol_factory: Callable[[], asyncio.BaseProtocol]
    ) -> tuple[asyncio.Transport, asyncio.BaseProtocol, tuple[str, int]]:
        if self.direct_literals and _is_ip_literal(host):
            self.counted[LOCAL].inc()
            return await super().dial(host, port, protocol_factory)
        verdict, rest = await self.routes.ask(host, port)
        if verdict in self.counted:
            self.counted[verdict].inc()
        if verdict == MESH:
            raise HandOver(host)
        if verdict == REFUSE:
            code = rest[0] if rest else replies.GENERAL_FAILURE
            raise DialError(code, f"{host}:{port}: {replies.WORDS.get(code, code)} (the node's answer)")
        try:
            addrs: list[IPAddress] = [ipaddress.ip_address(a) for a in rest.decode().split(",")]
        except ValueError:
            raise DialError(replies.GENERAL_FAILURE, f"bad route answer for {host}") from None
        token = _ANSWERED.set(addrs)
        try:
            return await super().dial(host, port, protocol_factory)
        finally:
            _ANSWERED.reset(token)

    async def resolve(self, host: str, port: int) -> list[IPAddress]:
        addrs = _ANSWERED.get(None)
        if addrs is None:  # only the node's process resolves (its pipeline, its mesh names)
            raise DialError(replies.HOST_UNREACHABLE, f"{host}: not resolved by the node")
        return addrs


def send_handover(hand: socket.socket, client: ClientProtocol, request: socks5.Request) -> bool:
    """The client's socket, its request and the bytes behind it, to the node's process."""
    transport = client.transport
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None:
        return False
    data = encode_handover(request, client.core.trailing_data())
    if len(data) > MAX_HANDOVER:
        return False
    try:
        hand.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [sock.fileno()]))])
    except OSError:  # the node's process is gone or not keeping up: the client gets 0x01
        return False
    return True


async def _serve(sock: socket.socket, hand: socket.socket, config: Config, index: int,
                 direct_literals: bool) -> int:
    loop = asyncio.get_running_loop()
    reader, writer = await asyncio.open_unix_connection(sock=sock)
    limits = config.limits
    routes = ParentRoutes(writer, config.socks5.max_clients)
    dialer = WorkerDialer(routes, index, direct_literals, connect_timeout=limits.socks5_connect_timeout,
                          write_high_water=limits.socks5_write_high_water)
    server = Socks5Server(config, dialer, BufferPool(capacity=4096, headroom=0, max_free=4))
    server.hand_over = lambda client, request: send_handover(hand, client, request)
    listen = config.socks5.listen
    try:
        await server.start(listen.host, listen.port, reuse_port=True)
    except OSError as e:
        writer.write(frame(b"E", f"socks5 worker {index}: {StartupError(str(e))}".encode()))
        await writer.drain()
        return 2
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    writer.write(frame(b"R", json.dumps({"pid": os.getpid()}).encode()))

    async def control() -> None:
        while True:
            got = await read_frame(reader)
            if got is None or got[0] == b"S":
                break
            if got[0] == b"A":
                routes.answered(got[1])
            elif got[0] == b"U":  # a reload's users and limits (trusted: our parent)
                users, new_limits = pickle.loads(got[1])
                server.set_users(users)
                server.set_limits(new_limits)
        stop.set()

    tasks = [loop.create_task(control()), loop.create_task(report_counters(writer))]
    await stop.wait()
    routes.close()
    await server.close()
    for t in tasks:
        t.cancel()
    await final_report(writer)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    sock = socket.socket(fileno=int(argv[0]))
    hand = socket.socket(fileno=int(argv[1]))
    hand.setblocking(False)
    setup = read_setup(sock)
    if setup is None:
        return 1
    config: Config = setup["config"]
    logs.setup(config.log_level)
    loop = new_loop(setup["loop"])
    try:
        return loop.run_until_complete(_serve(sock, hand, config, int(setup["index"]),
                                              bool(setup.get("direct_literals"))))
    finally:
        loop.close()


if __name__ == "__main__":
    sys.exit(main())
