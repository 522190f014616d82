"""ODoH client: `meshgate dns query NAME --odoh --proxy URL --target URL`, and the
`odoh://` upstream the resolver pipeline can use.

The client fetches the target's `ObliviousDoHConfigs` from
`https://TARGET/.well-known/odohconfigs` (cached for its Cache-Control
max-age, refetched when the target answers 401 after a key rotation), seals
each query to the target's key and POSTs it to the proxy's URI with
`targethost`/`targetpath`; the proxy learns who asks, never what.

The config fetch goes to the target directly (the proxy forwards only ODoH
POSTs), so the target learns that this address uses it, never what it asks:
the queries themselves only ever travel through the proxy.

Upstream URL form: `odoh://TARGET[:PORT]/PATH?proxy=https://PROXY[:PORT]/PATH`.
Without `proxy=` the query goes straight to the target (still encrypted, but
the target then sees the client's address: only for testing).
"""

from __future__ import annotations

import argparse
import asyncio
import ssl
import sys
import time
from dataclasses import dataclass
from urllib.parse import parse_qs, quote, urlsplit

from meshgate.dns import odoh
from meshgate.dns.h2client import H2ClientError, H2Pool, H2Response, client_ssl_context
from meshgate.dns.upstream import Upstream, UpstreamError, UpstreamOptions
from meshgate.metrics import REGISTRY
from meshgate.netfmt import authority

_queries = REGISTRY.counter(
    "meshgate_odoh_client_queries_total", "ODoH queries sent by this node as a client", ("result",)
)
_Q_OK = _queries.labels("ok")
_Q_FAIL = _queries.labels("error")
_config_fetches = REGISTRY.counter("meshgate_odoh_client_config_fetches_total", "ODoH config fetches")

DEFAULT_CONFIG_TTL = 3600.0
MAX_CONFIG_TTL = 86400.0
# RFC 8467: queries padded to 128-byte blocks hide their length from the proxy.
QUERY_PAD_BLOCK = 128


class OdohClientError(Exception):
    pass


@dataclass(frozen=True)
class HttpsEndpoint:
    host: str
    port: int
    path: str

    @property
    def authority(self) -> str:
        return authority(self.host, self.port, 443)


def parse_endpoint(url: str, default_path: str) -> HttpsEndpoint:
    """`https://host[:port][/path]`, or bare `host[:port][/path]`. A URI template's
    `{?targethost,targetpath}` suffix (RFC 9230's form) is accepted and dropped."""
    brace = url.find("{")
    if brace >= 0:
        url = url[:brace]
    if "://" not in url:
        url = "https://" + url
    parts = urlsplit(url)
    if parts.scheme not in ("https", "odoh"):
        raise OdohClientError(f"{url!r}: expected an https:// URL")
    if not parts.hostname:
        raise OdohClientError(f"{url!r} has no host")
    try:
        port = parts.port or 443
    except ValueError:
        raise OdohClientError(f"{url!r} has an invalid port") from None
    return HttpsEndpoint(parts.hostname, port, parts.path or default_path)


def padding_for(length: int, block: int = QUERY_PAD_BLOCK) -> int:
    """Zero bytes that bring a DNS message (plus its length fields) to a block boundary."""
    return -(length + 4) % block


def _max_age(resp: H2Response) -> float:
    cc = resp.header(b"cache-control")
    if cc:
        for part in cc.decode("latin-1").split(","):
            name, _, value = part.strip().partition("=")
            if name.lower() == "max-age" and value.isdigit():
                return min(float(value), MAX_CONFIG_TTL)
    return DEFAULT_CONFIG_TTL


class OdohClient:
    """Seals queries for one target and sends them through one proxy (or directly)."""

    def __init__(
        self,
        target: HttpsEndpoint,
        proxy: HttpsEndpoint | None,
        ssl_ctx: ssl.SSLContext,
        timeout: float = 5.0,
        pool: H2Pool | None = None,
    ) -> None:
        self.target = target
        self.proxy = proxy
        self.timeout = timeout
        self.pool = pool or H2Pool(ssl_ctx, max_connections=4, max_body=odoh.MAX_MESSAGE_LEN)
        self._config: odoh.ObliviousDoHConfigContents | None = None
        self._config_expires = 0.0
        self._config_lock = asyncio.Lock()

    async def config(self, refresh: bool = False) -> odoh.ObliviousDoHConfigContents:
        async with self._config_lock:  # one fetch serves every query waiting for it
            if self._config is not None and not refresh and time.monotonic() < self._config_expires:
                return self._config
            t = self.target
            resp = await self.pool.request(
                t.host, t.port, t.host, b"GET", odoh.CONFIGS_PATH.encode(), [], b"", self.timeout
            )
            _config_fetches.inc()
            if resp.status != 200:
                raise OdohClientError(f"{t.authority}{odoh.CONFIGS_PATH} answered HTTP {resp.status}")
            try:
                configs = odoh.decode_configs(resp.body)
            except odoh.OdohError as e:
                raise OdohClientError(f"{t.authority} sent unusable ODoH configs: {e}") from None
            if not configs:
                raise OdohClientError(f"{t.authority} offers no ODoH config this client supports")
            self._config = configs[0]
            self._config_expires = time.monotonic() + _max_age(resp)
            return self._config

    async def _send(self, body: bytes) -> H2Response:
        headers = [
            (b"content-type", odoh.MEDIA_TYPE.encode()),
            (b"accept", odoh.MEDIA_TYPE.encode()),
            (b"cache-control", b"no-cache, no-store"),
        ]
        if self.proxy is None:
            t = self.target
            return await self.pool.request(
                t.host, t.port, t.host, b"POST", t.path.encode(), headers, body, self.timeout
            )
        p = self.proxy
        path = (
            f"{p.path}?targethost={quote(self.target.authority, safe=':[]')}"
            f"&targetpath={quote(self.target.path, safe='/')}"
        )
        return await self.pool.request(p.host, p.port, p.host, b"POST", path.encode(), headers, body,
                                       self.timeout)

    async def query(self, wire: bytes) -> bytes:
        """Resolve one DNS message; returns the target's DNS answer."""
        try:
            answer = await self._query(wire, retry=True)
        except BaseException:
            _Q_FAIL.inc()
            raise
        _Q_OK.inc()
        return answer

    async def _query(self, wire: bytes, retry: bool) -> bytes:
        config = await self.config()
        sealed, ctx = odoh.seal_query(config, wire, padding_for(len(wire)))
        resp = await self._send(sealed)
        if resp.status == 401 and retry:
            # The target rotated its key past our cached config: fetch it once more.
            await self.config(refresh=True)
            return await self._query(wire, retry=False)
        if resp.status != 200:
            status = resp.header(b"proxy-status")
            via = f" (Proxy-Status: {status.decode('latin-1')})" if status else ""
            raise OdohClientError(f"HTTP {resp.status}{via}")
        try:
            return ctx.open_response(resp.body)
        except odoh.OdohError as e:
            raise OdohClientError(f"cannot open the target's response: {e}") from None

    def close(self) -> None:
        self.pool.close()


class OdohUpstream(Upstream):
    """An `odoh://TARGET/PATH?proxy=https://PROXY/PATH` upstream for the resolver
    (the `Upstream.exchange` interface of meshgate.dns.upstream)."""

    def __init__(self, url: str, verify: bool | str = True) -> None:
        parts = urlsplit(url)
        if parts.scheme != "odoh":
            raise ValueError(f"{url!r} is not an odoh:// URL")
        proxies = parse_qs(parts.query).get("proxy", [])
        try:
            target = parse_endpoint(f"https://{parts.netloc}{parts.path}", "/dns-query")
            proxy = parse_endpoint(proxies[0], "/proxy") if proxies else None
        except OdohClientError as e:
            raise ValueError(str(e)) from None
        self.url = url
        ctx = client_ssl_context(insecure=verify is False, cafile=verify if isinstance(verify, str) else None)
        self.client = OdohClient(target, proxy, ctx)

    @classmethod
    def from_url(cls, url: str, rest: str, sni: str, options: UpstreamOptions) -> Upstream:
        return cls(url, options.verify)

    async def exchange(self, wire: bytes, timeout: float) -> bytes:
        self.client.timeout = timeout
        try:
            return await self.client.query(wire)
        except (OdohClientError, H2ClientError) as e:
            raise UpstreamError(f"{self.url}: {e}") from None

    def close(self) -> None:
        self.client.close()


# --------------------------------------------------------------------------- CLI


async def _run(args: argparse.Namespace) -> int:
    import dns.exception
    import dns.message
    import dns.rcode
    import dns.rdatatype

    from meshgate.dns.client import format_answer

    try:
        target = parse_endpoint(args.target, "/dns-query")
        proxy = parse_endpoint(args.proxy, "/proxy") if args.proxy else None
        qtype = dns.rdatatype.from_text(args.qtype)
    except (OdohClientError, dns.rdatatype.UnknownRdatatype) as e:
        print(f"meshgate: {e or 'unknown record type'}", file=sys.stderr)
        return 1
    q = dns.message.make_query(args.qname, qtype, use_edns=0)
    q.id = 0  # as DoH: HTTP matches answers to queries, and ID 0 caches best
    client = OdohClient(target, proxy, client_ssl_context(args.insecure, args.cafile), args.timeout)
    via = f"odoh {target.authority}{target.path}" + (f" via {proxy.authority}{proxy.path}" if proxy else "")
    start = time.monotonic()
    try:
        answer = dns.message.from_wire(await client.query(q.to_wire()))
    except (OdohClientError, H2ClientError) as e:
        print(f"meshgate: ODoH query failed: {e}", file=sys.stderr)
        return 2
    except dns.exception.DNSException as e:
        print(f"meshgate: the target's answer is not a DNS message: {e}", file=sys.stderr)
        return 2
    finally:
        client.close()
    print(format_answer(answer, via, time.monotonic() - start))
    return 0 if answer.rcode() in (dns.rcode.NOERROR, dns.rcode.NXDOMAIN) else 3


def main(args: argparse.Namespace) -> int:
    """`meshgate dns query NAME [TYPE] --odoh --proxy URL --target URL` (exit codes as
    meshgate.dns.client: 0 answered, 1 usage, 2 no answer, 3 SERVFAIL/REFUSED/...)."""
    if not args.target:
        print("meshgate: --odoh needs --target URL (and --proxy URL)", file=sys.stderr)
        return 1
    return asyncio.run(_run(args))
