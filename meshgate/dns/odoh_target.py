"""The ODoH target role (RFC 9230 section 4.4): open, resolve, seal.

The target sees what is asked but not who: the query goes through the node's
resolver pipeline with a fixed peer label instead of the client's (or the
proxy's) address, so nothing downstream - logs, counters, upstreams - can tie
a question to a connection.

Keys: `key_seed` gives a fixed key pair (HPKE DeriveKeyPair, the same key any
other ODoH server derives from that seed; rotate it by changing the seed).
Without a seed the key is fresh at start and replaced every `key_rotation`
seconds; the previous key stays accepted until the next rotation, so a
client holding a just-replaced config keeps working for one full period.

Answers are sealed straight into a pooled buffer (`seal_response_into`) that
the HTTP layer recycles once h2wire has copied it into its frames (the join in
`respond()`/`data_to_send()`), or, over HTTP/1.1 (h1server), once the TLS
transport holds nothing more; it drops it if the stream or connection goes first.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable

from meshgate.buffers import Buffer, BufferPool
from meshgate.config import DnsListenerConfig, LimitsConfig
from meshgate.dns import odoh
from meshgate.dns.h2server import Response, current_peer
from meshgate.dns.resolver import Frontend, Later, Pipeline, Ready
from meshgate.dns.stats import ListenerStats
from meshgate.logs import RateLimitedLog
from meshgate.metrics import REGISTRY

log = logging.getLogger("meshgate.dns.odoh")
rlog = RateLimitedLog(log)

# The peer every ODoH query is attributed to: deliberately not an address.
ANONYMOUS_PEER = "odoh-client"
# RFC 8467's response block: answers of similar size look alike to the proxy.
RESPONSE_PAD_BLOCK = 468
SEALED_BUFFER_CAPACITY = 4096
RESPONSE_OVERHEAD = 3 + odoh.RESPONSE_NONCE_LEN + 2 + 4 + odoh.TAG_LEN


_rotations = REGISTRY.counter("meshgate_odoh_key_rotations_total", "ODoH target key rotations")

NO_STORE = ("cache-control", "no-cache, no-store")


def response_padding(dns_len: int) -> int:
    return -(dns_len + 4) % RESPONSE_PAD_BLOCK


class OdohTarget:
    def __init__(
        self, cfg: DnsListenerConfig, limits: LimitsConfig, pipeline: Pipeline, stats: ListenerStats
    ) -> None:
        seeded = cfg.key_seed is not None
        first = odoh.TargetKey.from_seed(bytes.fromhex(cfg.key_seed)) if cfg.key_seed else (
            odoh.TargetKey.generate()
        )
        self.keys = odoh.TargetKeys(first)
        self.rotation = None if seeded else cfg.key_rotation
        self.stats = stats
        self.frontend = Frontend(pipeline, stats)
        self.pool = BufferPool(SEALED_BUFFER_CAPACITY, 0, limits.buffer_pool_size)
        self._configs = self.keys.configs()

    # ------------------------------------------------------------ keys

    def rotate(self, new: odoh.TargetKey | None = None) -> None:
        self.keys.rotate(new or odoh.TargetKey.generate())
        self._configs = self.keys.configs()
        _rotations.inc()
        log.info("odoh target: rotated key; new key id %s", self.keys.current.key_id[:4].hex())

    def configs(self) -> Response:
        """The `/.well-known/odohconfigs` reply: cacheable until the next rotation at most."""
        max_age = int(self.rotation) if self.rotation is not None else 86400
        return (200, [("content-type", "application/octet-stream"),
                      ("cache-control", f"max-age={max_age}")], self._configs)

    # ------------------------------------------------------------ queries

    def answer(self, body: bytes) -> Response | Awaitable[Response]:
        """One POSTed oblivious query: the reply now (cache hit, local name,
        error) or an awaitable of it (the pipeline goes upstream)."""
        try:
            query, ctx = self.keys.open_query(body)
        except odoh.OdohError as e:
            reason = "unknown_key" if e.status == 401 else "undecryptable"
            self.stats.error(reason)
            # The connection's peer is normally the proxy; logging it ties no question to anyone.
            peer = current_peer.get()
            rlog.debug(f"odoh {reason} {peer}", "odoh target: rejected a query from %s (%s): %s",
                       peer, e.status, e)
            return (e.status, [NO_STORE], b"")
        res = self.frontend.query(query, asyncio.get_running_loop().time(), ANONYMOUS_PEER)
        if isinstance(res, Ready):
            return self._seal(ctx, res.buffer)
        if res is None:  # not a DNS query at all (FORMERR-able ones come back as answers)
            return (400, [NO_STORE], b"")
        return self._seal_later(ctx, res)

    async def _seal_later(self, ctx: odoh.ResponseContext, later: Later) -> Response:
        try:
            ready = await later.answer
        except asyncio.CancelledError:  # the HTTP stream is gone
            later.abandon()
            raise
        return self._seal(ctx, ready.buffer if ready is not None else None)

    def _seal(self, ctx: odoh.ResponseContext, answer: Buffer | None) -> Response:
        if answer is None:  # dropped under load (limits.dns_max_inflight)
            return (503, [NO_STORE, ("retry-after", "1")], b"")
        n = answer.length
        pad = response_padding(n)
        need = n + pad + RESPONSE_OVERHEAD
        out = self.pool.get() if need <= SEALED_BUFFER_CAPACITY else Buffer(need, 0)
        try:
            with answer.view() as msg, memoryview(out.data) as dst:
                out.length = ctx.seal_response_into(dst[out.headroom :], msg, pad)
        except Exception:
            answer.drop()
            out.drop()
            self.stats.error("seal")
            rlog.debug("odoh seal", "odoh target: sealing an answer failed")
            return (500, [NO_STORE], b"")
        answer.recycle()  # the encryption copied it; nothing else holds it
        return (200, [("content-type", odoh.MEDIA_TYPE), NO_STORE], out)

    def close(self) -> None:
        self.frontend.close()
