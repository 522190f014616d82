"""The SOCKS5 portal's asyncio adapter: handshake, dial, relay.

Per client one `ClientProtocol`; after a successful CONNECT an
`UpstreamProtocol` on the dialer's transport. The relay writes each chunk
straight into the other side's transport (no queue, no await) and uses the
transports' own flow control for backpressure: each transport's high-water
mark is `limits.socks5_write_high_water`, and when one side's write buffer
crosses it, `pause_writing` pauses reading on the other side until
`resume_writing`. Either side's EOF is passed on with `write_eof` (half-close)
and the pair closes once both directions have ended.

The upstream is reached only through the asyncio Transport/Protocol
interface, so a mesh stream that behaves like a transport drops in through
the dialer.

With `limits.socks5_splice` on, a relay between two TCP sockets that shows bulk (a read of
BULK_READ bytes or more) with nothing queued on either side moves to `SpliceRelay`
(gateway/splice_relay.py): from then on the kernel moves the bytes both ways (splice(2)
through a pipe), and they no longer pass through Python. It is off by default: on Linux 6.18
loopback the Python relay's 2 MiB reads and writes moved more, for about the same CPU.

With `socks5.workers` > 1 (gateway/workers.py) the same server runs in worker
processes too: there a connection whose destination does not leave from this
host (the dialer raises `HandOver`), and every UDP ASSOCIATE, is handed with
its request to the node's process (`hand_over`), which resumes it where the
worker stopped (`Socks5Server.adopt`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable, Coroutine
from typing import Any, cast

from meshgate.buffers import BufferPool
from meshgate.config import Config, LimitsConfig, User
from meshgate.egress.dialer import Dialer, DialError
from meshgate.gateway import socks5
from meshgate.gateway.splice_relay import PIPE_SIZE, SpliceRelay
from meshgate.gateway.udp import UdpAssociation
from meshgate.logs import RateLimitedLog
from meshgate.metrics import REGISTRY, LocalCounter
from meshgate.netfmt import host_port

log = logging.getLogger("meshgate.gateway")
rlog = RateLimitedLog(log)

CLIENTS = REGISTRY.gauge("meshgate_socks5_clients", "SOCKS5 client connections open now")
ACCEPTED = REGISTRY.counter("meshgate_socks5_clients_total", "SOCKS5 client connections accepted")
REFUSED = REGISTRY.counter(
    "meshgate_socks5_clients_refused_total", "SOCKS5 connections closed at once: max_clients reached"
)
REFUSED_PER_SOURCE = REGISTRY.counter(
    "meshgate_socks5_clients_refused_per_source_total",
    "SOCKS5 connections closed at once: limits.socks5_max_clients_per_source reached for their address",
)
CONNECTS = REGISTRY.counter(
    "meshgate_socks5_requests_total", "SOCKS5 requests answered, by command and reply", ("command", "reply")
)
BYTES = REGISTRY.counter(
    "meshgate_socks5_bytes_total", "Bytes relayed: in = from clients, out = to clients", ("direction",)
)
AUTH_FAILURES = REGISTRY.counter("meshgate_socks5_auth_failures_total", "RFC 1929 authentication failures")
BAD_REQUESTS = REGISTRY.counter(
    "meshgate_socks5_bad_requests_total", "SOCKS5 protocol errors from clients", ("kind",)
)
TIMEOUTS = REGISTRY.counter("meshgate_socks5_timeouts_total", "SOCKS5 connections timed out", ("phase",))
# A dial run by DialStep that raised past its own handlers (a bug: the dial answers every
# failure it expects); with a Task the loop's handler would have reported it
DIAL_STEP_ERRORS = REGISTRY.counter(
    "meshgate_socks5_dial_step_errors_total", "Task-less dials that ended in an unexpected exception"
).labels()

_READ_BUFFER_RENEWED = REGISTRY.counter(
    "meshgate_socks5_read_buffer_renewed_total",
    "Relay reads whose write did not drain at once, so the read buffer was handed over and replaced",
)
HANDED_OVER = REGISTRY.counter(
    "meshgate_socks5_handed_over_total",
    "SOCKS5 connections a worker process (socks5.workers) passed to the node's process, by outcome",
    ("result",),
)
SPLICED = REGISTRY.counter(
    "meshgate_socks5_spliced_total",
    "Relays between two TCP sockets handed to the kernel (splice) once they showed bulk",
)
# children looked up once: a family's inc() finds its child by label values on every call
_ACCEPTED = ACCEPTED.labels()
_CLIENTS = CLIENTS.labels()
_CONNECT_OK = CONNECTS.labels("connect", "succeeded")
_BYTES_IN = BYTES.labels("in")
_BYTES_OUT = BYTES.labels("out")
_HANDSHAKE_TIMEOUTS = TIMEOUTS.labels("handshake")
_IDLE_TIMEOUTS = TIMEOUTS.labels("idle")
_COMMAND_NAMES = {socks5.CMD_CONNECT: "connect", socks5.CMD_BIND: "bind", socks5.CMD_UDP_ASSOCIATE: "udp"}

# Flush byte counters every this many bytes (and at close): per read, not per byte,
# and not a lock per read either.
_BYTES_FLUSH = 1 << 20

# A timer this close to a phase's deadline counts as at it (uvloop's clock and timers tick in
# milliseconds, and round a deadline up): not replaced for a deadline as good as its own, and
# no second wake-up for what is left when it fires.
_TIMER_SLACK = 0.005

# Bytes read per receive on the relay (one buffer per server, see ReadBuffer). 2 MiB, not
# asyncio's and uvloop's own 256 KiB: fewer and larger reads and writes carried 1 GiB through the
# portal about 1.5x faster on Linux 6.18 loopback, and 1 MiB and 4 MiB less fast
# (docs/OPERATIONS.md). A direction holds at most one read beyond limits.socks5_write_high_water.
READ_SIZE = 2 * 1024 * 1024
# A read this large that the destination took at once shows a bulk relay (limits.socks5_splice)
BULK_READ = 256 * 1024


class ReadBuffer:
    """The one receive buffer every relay on a server reads into.

    Reads are strictly serial on an event loop (get_buffer, the receive,
    buffer_updated, then the next), and each read is written on at once, so
    one buffer serves every connection: no bytes object allocated and filled
    per read. The rule of meshgate/buffers.py still holds: if the write did
    not drain (the transport may keep a view of this memory, as uvloop does),
    the buffer is given up to that transport and a fresh one takes its place.
    """

    __slots__ = ("renewed", "size", "view")

    def __init__(self, size: int = READ_SIZE) -> None:
        self.size = size
        self.view = memoryview(bytearray(size))
        self.renewed = 0

    def renew(self) -> None:
        self.view = memoryview(bytearray(self.size))
        self.renewed += 1
        _READ_BUFFER_RENEWED.inc()


class HandOver(Exception):
    """A worker's dialer: this destination is the node's process's to dial (it needs the
    mesh, or this node's own egress), so the connection moves there."""


# (client, request) -> handed over? A worker process sets it on its server.
HandOverFn = Callable[["ClientProtocol", socks5.Request], bool]


def peer_text(peer: Any) -> str:
    if not peer:
        return "?"
    return host_port(peer[0], peer[1])


class Socks5Server:
    """Owns the listener and every client; `close()` ends them all."""

    loop: asyncio.AbstractEventLoop

    def __init__(self, config: Config, dialer: Dialer, pool: BufferPool) -> None:
        self.config = config
        self.dialer = dialer
        self.pool = pool
        self.users: dict[bytes, bytes] = {}
        self.set_users(config.socks5.users)
        self.max_clients = config.socks5.max_clients
        self.udp_enabled = config.socks5.udp
        self.clients: set[ClientProtocol] = set()
        # live clients per source address: one address cannot hold every slot
        self.per_source: dict[str, int] = {}
        self.set_limits(config.limits)
        self.server: asyncio.Server | None = None
        self.read_buffer = ReadBuffer()
        # the loop its clients run on: the running one (a server is made on it), else start's
        with contextlib.suppress(RuntimeError):
            self.loop = asyncio.get_running_loop()
        self.hand_over: HandOverFn | None = None  # set in a worker process
        # this host's own dialer, nothing layered on it: an address literal's dial awaits only the
        # loop's create_connection, so it runs without a Task (DialStep) on a socket transport
        self.plain_dialer = type(dialer) is Dialer

    def set_users(self, users: tuple[User, ...]) -> None:
        """The RFC 1929 users (also a reload's): connections accepted from now on check these;
        those already past their handshake keep going."""
        self.users = {u.name.encode(): u.password.encode() for u in users}

    def set_limits(self, limits: LimitsConfig) -> None:
        """`[limits]` (at start, and a reload's): the handshake and idle timeouts are read when a
        timer is armed and the per-source cap when a connection arrives, so connections see the
        new values from their next timer or arrival; none is closed by the change."""
        self.limits = limits
        # default: a quarter of max_clients, but never fewer than one browser's ~32 connections
        self.max_per_source = limits.socks5_max_clients_per_source or max(
            self.max_clients // 4, min(self.max_clients, 32)
        )

    async def start(self, host: str, port: int, reuse_port: bool = False) -> asyncio.Server:
        loop = self.loop = asyncio.get_running_loop()
        self.server = await loop.create_server(self.make_client, host, port, backlog=1024,
                                               reuse_port=reuse_port or None)
        return self.server

    def make_client(self) -> ClientProtocol:
        return ClientProtocol(self)

    async def adopt(self, sock: Any, request: socks5.Request, trailing: bytes) -> None:
        """A connection a worker handed over after its handshake: go on from its request (the
        reply and everything after it come from this process)."""
        client = ClientProtocol(self)
        client.resume = (request, trailing)
        await self.loop.connect_accepted_socket(lambda: client, sock)

    @property
    def sockname(self) -> tuple[str, int]:
        assert self.server is not None
        s = self.server.sockets[0].getsockname()
        return str(s[0]), int(s[1])

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for c in list(self.clients):
            c.abort()
        if self.server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.server.wait_closed(), 5)
            self.server = None


class DialStep:
    """Runs a dial coroutine without a Task: for one that awaits nothing but futures and needs
    no task of its own (no asyncio.timeout, no context variables), which is what the plain
    Dialer's dial to an address literal is (loop.create_connection). A Task costs some 8 µs
    on CPython 3.11 (its registration in a weak set, a loop turn before its first step and
    the weak reference's callback when it goes), a connection's whole Python dial about as
    much again. `done()` and `cancel()` as a Task's: a cancel throws CancelledError in where
    the coroutine waits (through the future it waits on), and the coroutine's own handlers
    answer the client."""

    __slots__ = ("_cancel", "_coro", "_done", "_fut", "_loop")

    def __init__(self, loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, None]) -> None:
        self._loop = loop
        self._coro = coro
        self._fut: asyncio.Future[Any] | None = None
        self._cancel = False
        self._done = False

    def start(self) -> None:
        self._step()

    def done(self) -> bool:
        return self._done

    def cancel(self) -> bool:
        if self._done:
            return False
        fut = self._fut
        if fut is None or not fut.cancel():  # between steps: thrown in at the next one
            self._cancel = True
        return True

    def _wake(self, _fut: object = None) -> None:
        self._fut = None
        self._step()

    def _step(self) -> None:
        try:
            if self._cancel:
                self._cancel = False
                got = self._coro.throw(asyncio.CancelledError())
            else:
                got = self._coro.send(None)
        except (StopIteration, asyncio.CancelledError):
            self._done = True
            return
        except Exception as e:
            self._done = True
            DIAL_STEP_ERRORS.inc()
            rlog.warning("dial-step", "socks5: a dial ended in an unexpected error: %r", e)
            return
        if got is None:  # a bare yield: go on in the next loop turn
            self._loop.call_soon(self._wake)
            return
        got._asyncio_future_blocking = False
        self._fut = got
        got.add_done_callback(self._wake)


_HANDSHAKE, _CONNECTING, _RELAY, _UDP, _CLOSED = range(5)


class ClientProtocol(asyncio.BufferedProtocol):
    """One SOCKS client connection, from greeting to close.

    The admission, timers and relay are shared with the HTTP proxy
    (gateway/http_proxy.py), which subclasses this with its own handshake: the
    class attributes below are what it counts into and how it names itself in logs.
    """

    kind = "socks5"
    splice_bulk = True  # a bulk relay between two sockets may move to SpliceRelay
    m_clients = _CLIENTS
    m_accepted = _ACCEPTED
    m_refused = REFUSED.labels()
    m_refused_per_source = REFUSED_PER_SOURCE.labels()
    m_handshake_timeouts = _HANDSHAKE_TIMEOUTS
    m_idle_timeouts = _IDLE_TIMEOUTS
    m_bytes_in = _BYTES_IN
    m_bytes_out = _BYTES_OUT

    def __init__(self, server: Socks5Server) -> None:
        self.server = server
        self.loop = server.loop
        self.state = _HANDSHAKE
        self.transport: asyncio.Transport | None = None
        self.upstream: asyncio.Transport | None = None
        self.peer: Any = None
        self.core = socks5.ServerConnection(server.users)
        self.udp: UdpAssociation | None = None
        self._counted = False
        self._source = ""  # the address counted in server.per_source
        # One timer for every phase (handshake, dial, relay idle checks): see _arm
        self._timer: asyncio.TimerHandle | None = None
        self._deadline = 0.0  # when the phase under way runs out (loop time)
        self._dialing: tuple[str, int] | None = None  # host, port of the dial under way
        self._active = False  # any traffic since the last idle check
        self._client_eof = False
        self._upstream_eof = False
        self._held: list[bytes] = []  # destination data that arrived before our reply
        self._connect_task: asyncio.Task[None] | DialStep | None = None
        self._bytes_in = LocalCounter(self.m_bytes_in, _BYTES_FLUSH)
        self._bytes_out = LocalCounter(self.m_bytes_out, _BYTES_FLUSH)
        # handed over by a worker: the request it read and the bytes the client sent behind it
        self.resume: tuple[socks5.Request, bytes] | None = None
        self._splice: SpliceRelay | None = None  # the kernel moves this relay's bytes

    # ----------------------------------------------------------------- lifecycle

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses: cast, don't assert
        transport = cast(asyncio.Transport, transport)
        self.transport = transport
        self.peer = transport.get_extra_info("peername")
        srv = self.server
        if len(srv.clients) >= srv.max_clients:
            self.m_refused.inc()
            rlog.debug(f"{self.kind}:max_clients", "%s: refusing %s: max_clients=%d reached",
                       self.kind, peer_text(self.peer), srv.max_clients)
            self.state = _CLOSED
            transport.abort()
            return
        source = str(self.peer[0]) if self.peer else "?"
        held = srv.per_source.get(source, 0)
        if held >= srv.max_per_source:
            self.m_refused_per_source.inc()
            rlog.debug(f"{self.kind}:per_source:{source}", "%s: refusing %s: %d connections from %s"
                       " already (limits.socks5_max_clients_per_source)", self.kind,
                       peer_text(self.peer), held, source)
            self.state = _CLOSED
            transport.abort()
            return
        srv.per_source[source] = held + 1
        self._source = source
        srv.clients.add(self)
        self._counted = True
        if self.resume is None:  # a handed-over connection was counted by its worker
            self.m_accepted.inc()
        self.m_clients.inc()
        transport.set_write_buffer_limits(high=srv.limits.socks5_write_high_water)
        self._arm(srv.limits.socks5_handshake_timeout)
        if self.resume is not None:
            request, trailing = self.resume
            self.resume = None
            self.core.resume(trailing)
            self._request(request)

    def connection_lost(self, exc: Exception | None) -> None:
        self.state = _CLOSED
        if self._counted:
            self._counted = False
            srv = self.server
            srv.clients.discard(self)
            left = srv.per_source[self._source] - 1
            if left:
                srv.per_source[self._source] = left
            else:
                del srv.per_source[self._source]
            self.m_clients.dec()
        self._disarm()
        if self._connect_task is not None and not self._connect_task.done():
            self._connect_task.cancel()
        if self.upstream is not None:
            self.upstream.close()  # flushes what the client already sent
        if self.udp is not None:
            self.udp.close()
            self.udp = None
        if self._splice is not None:
            self._splice.close()
            self._splice = None
        self._bytes_in.flush()
        self._bytes_out.flush()

    def abort(self) -> None:
        if self._splice is not None:
            self._splice.close()
        if self.transport is not None:
            self.transport.abort()
        if self.upstream is not None:
            self.upstream.abort()

    def close(self) -> None:
        if self._splice is not None:
            self._splice.close()
        if self.transport is not None:
            self.transport.close()
        if self.upstream is not None:
            self.upstream.close()

    # ----------------------------------------------------------------- reading

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.server.read_buffer.view

    def buffer_updated(self, nbytes: int) -> None:
        rb = self.server.read_buffer
        if self.state == _RELAY:  # the hot path
            up = self.upstream
            if up is None:
                return  # the destination is gone; this connection is closing
            up.write(rb.view[:nbytes])
            if up.get_write_buffer_size():
                rb.renew()  # the transport may hold a view of it: never reuse
            elif nbytes >= BULK_READ:
                self.maybe_splice()  # bulk, and all of it went out: the kernel can take over
            self._active = True
            self._bytes_in.add(nbytes)
            return
        self.data_received(bytes(rb.view[:nbytes]))

    def data_received(self, data: bytes) -> None:
        if self.state == _RELAY:
            if self.upstream is not None:
                self._active = True
                self._bytes_in.add(len(data))
                self.upstream.write(data)
            return
        if self.state == _HANDSHAKE:
            self._handshake(data)
        elif self.state == _CONNECTING:
            # Bytes the client sent behind its request before our reply: kept and forwarded
            # after it, and reading stops until then (see hold_while_dialing).
            self.core.receive_data(data)
            self.hold_while_dialing()
        elif self.state == _UDP:
            self._active = True  # the control connection carries nothing; ignore it

    def eof_received(self) -> bool:
        self._client_eof = True
        if self.state == _RELAY:
            up = self.upstream
            if up is None:
                return False
            if self._upstream_eof:
                self.close()
                return False
            if up.can_write_eof():
                up.write_eof()
            else:
                up.close()
            return True  # keep the reply direction open (half-close)
        # While dialing the request is in and the reply may still go out; in
        # the handshake or on a UDP control connection EOF ends it.
        return self.state == _CONNECTING

    # ----------------------------------------------------------------- flow control

    def pause_writing(self) -> None:
        # The client reads slower than the upstream sends: stop reading upstream.
        if self.upstream is not None and self._splice is None:
            self.upstream.pause_reading()

    def resume_writing(self) -> None:
        if self.upstream is not None and not self.upstream.is_closing() and self._splice is None:
            self.upstream.resume_reading()

    # ----------------------------------------------------------------- kernel relay

    def maybe_splice(self) -> None:
        """Hand this relay to the kernel (SpliceRelay) if it is one between two TCP sockets,
        both directions still open, nothing queued in either transport (so no byte written
        before can be overtaken), and limits.socks5_write_high_water allows a pipe's worth
        (PIPE_SIZE) in flight each way. Called after a read of BULK_READ or more that drained."""
        if self._splice is not None or not self.splice_bulk or self.state != _RELAY:
            return
        if not self.server.limits.socks5_splice:
            return  # off unless configured: the Python relay moved more (limits.socks5_splice)
        if self.server.limits.socks5_write_high_water < PIPE_SIZE:
            return  # a pipe holds PIPE_SIZE per direction: more than the configured bound in flight
        client, up = self.transport, self.upstream
        if client is None or up is None or self._client_eof or self._upstream_eof:
            return
        if client.get_write_buffer_size() or up.get_write_buffer_size():
            return
        cs, us = client.get_extra_info("socket"), up.get_extra_info("socket")
        if cs is None or us is None or cs.type != socket.SOCK_STREAM or us.type != socket.SOCK_STREAM:
            return
        try:
            relay = SpliceRelay(self.loop, cs.fileno(), us.fileno(), self._spliced, self._splice_done)
        except OSError as e:  # out of descriptors, or no pipes here: the relay stays in Python
            rlog.debug("splice", "%s: relay for %s stays in Python: %s", self.kind, peer_text(self.peer), e)
            return
        client.pause_reading()
        up.pause_reading()
        self._splice = relay
        SPLICED.inc()

    def _spliced(self, direction: int, n: int) -> None:
        self._active = True
        (self._bytes_in if direction == 0 else self._bytes_out).add(n)

    def _splice_done(self, error: OSError | None) -> None:
        self._splice = None
        if error is not None:
            rlog.debug("splice-end", "%s: relay for %s ended: %s", self.kind, peer_text(self.peer), error)
            self.abort()
        else:
            self.close()  # both directions ended (each passed on as it came)

    # ----------------------------------------------------------------- handshake

    def _handshake(self, data: bytes) -> None:
        core = self.core
        core.receive_data(data)
        transport = self.transport
        assert transport is not None
        try:
            while True:
                event = core.next_event()
                out = core.data_to_send()
                if out:
                    transport.write(out)
                if event is None:
                    return
                if isinstance(event, socks5.Request):
                    self._request(event)
                    return
        except socks5.Socks5Error as e:
            out = core.data_to_send()
            if out:
                transport.write(out)
            if e.kind == "auth":
                AUTH_FAILURES.inc()
            else:
                BAD_REQUESTS.labels(e.kind).inc()
            if e.reply is not None:
                CONNECTS.labels("invalid", socks5.REPLY_NAMES.get(e.reply, str(e.reply))).inc()
            rlog.debug(f"bad:{e.kind}", "socks5: %s from %s", e, peer_text(self.peer))
            transport.close()

    def _reply_and_close(self, request: socks5.Request, rep: int) -> None:
        CONNECTS.labels(_COMMAND_NAMES[request.command], socks5.REPLY_NAMES[rep]).inc()
        assert self.transport is not None
        self.transport.write(socks5.build_reply(rep))
        self.transport.close()

    def _request(self, request: socks5.Request) -> None:
        if request.command == socks5.CMD_BIND:
            self._reply_and_close(request, socks5.REP_COMMAND_NOT_SUPPORTED)
            return
        if request.command == socks5.CMD_UDP_ASSOCIATE and not self.server.udp_enabled:
            self._reply_and_close(request, socks5.REP_COMMAND_NOT_SUPPORTED)
            return
        assert self.transport is not None
        self.state = _CONNECTING
        if request.command == socks5.CMD_UDP_ASSOCIATE and self.server.hand_over is not None:
            self._hand_over(request)  # a worker: the node's process holds the UDP paths
            return
        if request.command == socks5.CMD_CONNECT:
            # the dial's time limit is this connection's timer (the dialer's connect_timeout), not
            # a second one inside the dial (Dialer.connect): one timer per connection
            host = request.host  # the address as text, made once
            if self.server.plain_dialer and request.atyp != socks5.ATYP_DOMAIN:
                # a socket transport for certain: straight to the buffered upstream, and no Task
                self.start_dial(host, request.port, self._connect(request, host, BufferedUpstream),
                                step=True)
            else:
                self.start_dial(host, request.port, self._connect(request, host))
        else:
            self._disarm()  # opening the UDP association is not timed; its idle checks are
            self._connect_task = self.loop.create_task(self._associate(request))

    async def _connect(self, request: socks5.Request, host: str,
                       upstream: type[UpstreamProtocol | BufferedUpstream] | None = None) -> None:
        port = request.port
        kind = upstream or UpstreamProtocol
        try:
            transport, _, bound = await self.server.dialer.dial(host, port, lambda: kind(self))
        except HandOver:
            if self.state == _CONNECTING:
                self._hand_over(request)
            return
        except DialError as e:
            self.dial_failed(e)
            return
        except Exception as e:  # never a traceback to the peer; reply and log
            log.warning("socks5: unexpected error connecting to %s:%d: %r", host, port, e)
            if self.state == _CONNECTING:
                self._reply_and_close(request, socks5.REP_GENERAL_FAILURE)
            return
        finally:
            self._connect_task = None
            self._dialing = None
        if self.state != _CONNECTING:  # the client left while we dialed
            transport.close()
            return
        _CONNECT_OK.inc()
        self.begin_relay(transport, socks5.build_reply(socks5.REP_SUCCEEDED, bound[0], bound[1]),
                         self.core.trailing_data())

    def hold_while_dialing(self) -> None:
        """A read arrived while dialing: what follows waits in the kernel until the reply
        (begin_relay resumes), so a connection holds at most that one read. Reading is
        stopped here, at the first such read, not when the dial starts: most clients send
        nothing before the reply, and each stop and start is an epoll_ctl in the loop."""
        if self.transport is not None:
            self.transport.pause_reading()

    def start_dial(self, host: str, port: int, dial: Coroutine[Any, Any, None], step: bool = False) -> None:
        """Run `dial` (a coroutine that calls dialer.dial for host:port and answers the client)
        within the dialer's connect_timeout, kept by this connection's timer (`_arm`): one timer
        per connection, not a second one inside the dial as Dialer.connect would make. `step`:
        `dial` awaits nothing but futures and needs no Task (DialStep runs it)."""
        self._dialing = (host, port)
        self._arm(self.server.dialer.connect_timeout)
        if step:
            run = DialStep(self.loop, dial)
            self._connect_task = run
            run.start()  # may finish at once (and clear _connect_task)
        else:
            self._connect_task = self.loop.create_task(dial)

    def dial_failed(self, e: DialError) -> None:
        """The dial failed or timed out: the reply code for it, then close."""
        rlog.debug(f"dial:{e.reply}", "socks5: %s for %s", e, peer_text(self.peer))
        if self.state == _CONNECTING:
            CONNECTS.labels("connect", socks5.REPLY_NAMES[e.reply]).inc()
            assert self.transport is not None
            self.transport.write(socks5.build_reply(e.reply))
            self.transport.close()

    def _hand_over(self, request: socks5.Request) -> None:
        """A worker passes this connection on (its socket, request and unread bytes) and forgets
        it; if that fails the client gets a general failure, as for any dial error."""
        hand_over = self.server.hand_over
        assert hand_over is not None
        if not hand_over(self, request):
            HANDED_OVER.labels("failed").inc()
            self._reply_and_close(request, socks5.REP_GENERAL_FAILURE)
            return
        HANDED_OVER.labels("ok").inc()
        self.state = _CLOSED
        if self.transport is not None:
            self.transport.abort()  # closes this process's descriptor only: the socket lives on there

    def begin_relay(self, transport: asyncio.Transport, reply: bytes, early: bytes) -> None:
        """The destination is connected: send `reply` to the client, `early` (what the client
        sent behind its request) to the destination, and relay both ways from here."""
        client = self.transport
        assert client is not None
        if reply:
            client.write(reply)
        self.state = _RELAY
        # What the destination sent before the reply went out (a banner) follows it.
        if self._held:
            held, self._held = self._held, []
            self._bytes_out.add(sum(len(d) for d in held))
            client.writelines(held)
        if self.upstream is None:  # the destination already closed: flush and end
            client.close()
            return
        if early:
            self._bytes_in.add(len(early))
            transport.write(early)
        if self._upstream_eof:
            self._upstream_eof = False
            if not self.upstream_eof():
                return
        else:
            transport.resume_reading()
        if self._client_eof:
            if not self.eof_received():
                return
        else:
            client.resume_reading()
        self._arm(self.server.limits.socks5_idle_timeout)

    async def _associate(self, request: socks5.Request) -> None:
        assert self.transport is not None
        try:
            assoc = await UdpAssociation.open(self, request)
        except OSError as e:
            rlog.debug("udp-open", "socks5: UDP ASSOCIATE for %s failed: %s", peer_text(self.peer), e)
            if self.state == _CONNECTING:
                self._reply_and_close(request, socks5.REP_GENERAL_FAILURE)
            return
        finally:
            self._connect_task = None
        if self.state != _CONNECTING:
            assoc.close()
            return
        self.udp = assoc
        self.state = _UDP
        host, port = assoc.bound
        CONNECTS.labels("udp", "succeeded").inc()
        self.transport.write(socks5.build_reply(socks5.REP_SUCCEEDED, host, port))
        if self._client_eof:
            self.transport.close()
            return
        self.transport.resume_reading()
        self._arm(self.server.limits.socks5_idle_timeout)

    # ----------------------------------------------------------------- upstream events

    def upstream_made(self, transport: asyncio.Transport) -> None:
        self.upstream = transport
        try:  # noqa: SIM105 (not contextlib.suppress: this runs once per connection)
            transport.set_write_buffer_limits(high=self.server.limits.socks5_write_high_water)
        except (AttributeError, NotImplementedError):
            pass

    def upstream_data(self, data: bytes) -> None:
        if self.state != _RELAY:
            # Connected, but the SOCKS reply has not gone out yet: hold this and
            # stop reading until it has (one read at most).
            self._held.append(data)
            if self.upstream is not None:
                self.upstream.pause_reading()
            return
        self._active = True
        self._bytes_out.add(len(data))
        assert self.transport is not None
        self.transport.write(data)

    def upstream_eof(self) -> bool:
        self._upstream_eof = True
        if self.state != _RELAY:
            return True  # passed on after the reply (see _connect)
        transport = self.transport
        if transport is None or transport.is_closing():
            return False
        if self._client_eof:
            self.close()
            return False
        if transport.can_write_eof():
            transport.write_eof()
        return True

    def upstream_lost(self) -> None:
        self.upstream = None
        if self.transport is not None and self.state != _CONNECTING:
            self.transport.close()  # after flushing what the upstream sent

    # ----------------------------------------------------------------- timers

    def _arm(self, seconds: float) -> None:
        """The phase starting now (handshake, dial, relay idle period) runs out in `seconds`.

        One timer handle serves a connection's every phase. It is replaced only when the new
        deadline comes before it would fire; otherwise it stays, and when it fires early
        (`_on_timer`) it sleeps again until the deadline. A short connection (handshake, dial,
        a little relaying, close) so makes one timer where it made one per phase."""
        loop = self.loop
        when = loop.time() + seconds
        self._deadline = when
        timer = self._timer
        if timer is None or timer.when() > when + _TIMER_SLACK:
            if timer is not None:
                timer.cancel()
            self._timer = loop.call_at(when, self._on_timer)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_timer(self) -> None:
        self._timer = None
        state = self.state
        if state == _CLOSED:
            return
        left = self._deadline - self.loop.time()
        if left > _TIMER_SLACK:  # armed for an earlier phase: this one runs out later
            self._timer = self.loop.call_at(self._deadline, self._on_timer)
            return
        if state == _HANDSHAKE:
            self._handshake_expired()
        elif state == _CONNECTING:
            self._dial_expired()
        else:
            self._idle_check()

    def _dial_expired(self) -> None:
        """The dial outlived the dialer's connect_timeout: it fails as the dialer's own limit
        (Dialer.connect) fails it, with reply 0x06 (TTL expired)."""
        target, task = self._dialing, self._connect_task
        if target is None or task is None or task.done():
            return  # not dialing (a UDP association opening)
        task.cancel()
        self.dial_failed(self.server.dialer.timed_out(*target))
        self._dialing = None

    def _handshake_expired(self) -> None:
        if self.state == _HANDSHAKE:
            self.m_handshake_timeouts.inc()
            rlog.debug(f"{self.kind}:handshake-timeout", "%s: handshake timeout for %s", self.kind,
                       peer_text(self.peer))
            self.abort()

    def _idle_check(self) -> None:
        # One timer per connection re-armed each period (not per read): a
        # connection closes after one to two idle periods without traffic.
        if self.state in (_CLOSED, _HANDSHAKE):
            return
        if self._active or (self.udp is not None and self.udp.take_activity()):
            self._active = False
            self._arm(self.server.limits.socks5_idle_timeout)
            return
        self.m_idle_timeouts.inc()
        rlog.debug(f"{self.kind}:idle-timeout", "%s: idle timeout for %s", self.kind, peer_text(self.peer))
        self.close()


class _UpstreamEvents:
    """What both upstream protocol kinds do besides reading: pass events to the client."""

    client: ClientProtocol

    def eof_received(self) -> bool:
        return self.client.upstream_eof()

    def connection_lost(self, exc: Exception | None) -> None:
        self.client.upstream_lost()

    def pause_writing(self) -> None:
        # The destination reads slower than the client sends: stop reading the client.
        t = self.client.transport
        if t is not None and not t.is_closing() and self.client._splice is None:
            t.pause_reading()

    def resume_writing(self) -> None:
        t = self.client.transport
        client = self.client
        if t is not None and not t.is_closing() and client.state == _RELAY and client._splice is None:
            t.resume_reading()


class UpstreamProtocol(_UpstreamEvents, asyncio.Protocol):
    """The destination side of one relay, for any transport the dialer returns.

    A transport that delivers bytes (a mesh stream, which only talks to an
    asyncio.Protocol) calls data_received. A socket transport gets swapped to
    `BufferedUpstream` at once, so its reads land in the shared read buffer:
    uvloop takes the buffered path only for a protocol that is not also an
    asyncio.Protocol, so one class cannot serve both.
    """

    def __init__(self, client: ClientProtocol) -> None:
        self.client = client

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.client.upstream_made(transport)  # type: ignore[arg-type]
        # A socket transport has a socket address (a mesh stream's is None). Asked by sockname,
        # which uvloop keeps from the connect, not by "socket", which costs a getsockname call
        # and an object per connection.
        if transport.get_extra_info("sockname") is not None:
            try:  # noqa: SIM105 (not contextlib.suppress: this runs once per connection)
                transport.set_protocol(BufferedUpstream(self.client))
            except (NotImplementedError, AttributeError):
                pass

    def data_received(self, data: bytes) -> None:
        self.client.upstream_data(data)


class BufferedUpstream(_UpstreamEvents, asyncio.BufferedProtocol):
    """The destination side on a socket transport: reads into the shared buffer. Swapped in by
    UpstreamProtocol, or made by the dial itself when the transport is a socket's for certain."""

    def __init__(self, client: ClientProtocol) -> None:
        self.client = client

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.client.upstream_made(transport)  # type: ignore[arg-type]

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.client.server.read_buffer.view

    def buffer_updated(self, nbytes: int) -> None:
        client = self.client
        rb = client.server.read_buffer
        if client.state == _RELAY:  # the hot path
            t = client.transport
            if t is None:
                return
            t.write(rb.view[:nbytes])
            if t.get_write_buffer_size():
                rb.renew()  # the transport may hold a view of it: never reuse
            elif nbytes >= BULK_READ:
                client.maybe_splice()
            client._active = True
            client._bytes_out.add(nbytes)
            return
        client.upstream_data(bytes(rb.view[:nbytes]))
