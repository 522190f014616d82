"""AEAD negotiation on real byte-pipe links (loopback TCP and QUIC sockets, in-process nodes;
docs/PROTOCOL.md section 2.6): a line A—B—C where A—B is tcp:// or quic:// and C—B udp://,
each node claiming AES instructions or not (limits.aes_instructions), negotiates per link, carries
a stream over both links, and shows each link's cipher in B's /peers rows, `meshgate status`
link lines and the metrics, all read through B's real admin API. And an on-path attacker who
holds the network secret gets no link up, whether it rewrites the offer in the handshake bytes
or terminates both handshakes itself."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from meshgate.config import from_dict
from meshgate.mesh.frames import PREFACE, LinkCodec, derive_psk
from meshgate.mesh.noise import AES_256_GCM, CHACHA20_POLY1305
from meshgate.mesh.service import MeshService
from meshgate.metrics import REGISTRY
from meshgate.node import Node
from tests.helpers import async_wait_until, free_port
from tests.mesh_testing import converged, node_config, sha_server, start_node, stop_all, stream_sha
from tests.unit.test_mesh_link_aead import rewrite_offer

ROOT = Path(__file__).resolve().parents[2]
NET, SECRET = "testnet", "correct horse battery"  # tests.mesh_testing.node_config's defaults
CHACHA, AES = CHACHA20_POLY1305.name, AES_256_GCM.name


async def admin_get(port: int, path: str) -> Any:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n".encode())
    data = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.split(b" ", 2)[1] == b"200", head
    return body.decode() if path == "/metrics" else json.loads(body)


def metric(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}} "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def meshgate_status(port: int) -> str:
    """What an operator runs: `meshgate status` against the admin API (a separate process)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "meshgate", "status", "--admin", f"127.0.0.1:{port}",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    return out.decode()


@pytest.mark.parametrize("scheme", ["tcp", "quic"])
@pytest.mark.parametrize(("a_aes", "b_aes", "c_aes"), [("yes", "yes", "no"), ("no", "yes", "yes")])
async def test_links_negotiate_and_show_their_cipher(
    scheme: str, a_aes: str, b_aes: str, c_aes: str, tmp_path: Path
) -> None:
    ab = AES if a_aes == b_aes == "yes" else CHACHA
    cb = AES if c_aes == b_aes == "yes" else CHACHA
    admin = free_port()
    b_node = Node(from_dict({
        "node": {"name": "b", "network": NET, "secret": SECRET, "ipv4": "10.9.5.2/24",
                 "state_dir": str(tmp_path / "b")},
        "mesh": {"listen": [f"{scheme}://127.0.0.1:0", "udp://127.0.0.1:0"], "traversal": False},
        "socks5": {"enable": False}, "admin": {"listen": f"127.0.0.1:{admin}"},
        "limits": {"aes_instructions": b_aes},
    }))
    await b_node.start()
    assert b_node.mesh is not None
    b = b_node.mesh
    pipe_url, udp_url = b.listen_addrs
    assert pipe_url.startswith(scheme) and udp_url.startswith("udp")
    metrics_before = await admin_get(admin, "/metrics")
    a = await start_node(node_config("a", "10.9.5.1/24", peers=[pipe_url],
                                     limits={"aes_instructions": a_aes}))
    c = await start_node(node_config("c", "10.9.5.3/24", peers=[udp_url],
                                     limits={"aes_instructions": c_aes}))
    nodes: list[MeshService] = [a, b, c]
    srv, port = await sha_server()
    try:
        await async_wait_until(lambda: converged(nodes), 20, f"routes over {scheme}:// and udp://")
        # each end of each link holds the same cipher
        assert {link.aead for links in a.links.values() for link in links} == {ab}
        assert {link.aead for links in c.links.values() for link in links} == {cb}
        # B's /peers rows through its admin API: one per link, naming its AEAD
        rows = {r["name"]: r for r in await admin_get(admin, "/peers")}
        assert set(rows) == {"a", "c"}
        assert rows["a"]["url"].startswith(scheme) and rows["a"]["aead"] == ab
        assert rows["c"]["url"].startswith("udp") and rows["c"]["aead"] == cb
        # `meshgate status` prints one line per link with its cipher
        status = await admin_get(admin, "/status")
        assert sorted(status["links"]) == sorted([f"a {rows['a']['url']} {ab}", f"c {rows['c']['url']} {cb}"])
        text = await meshgate_status(admin)
        assert f"a {rows['a']['url']} {ab}" in text and f"c {rows['c']['url']} {cb}" in text
        # the metrics, as Prometheus scrapes them: B counted its stream link's session by scheme
        # and suite (A's end, in this same process, counts too), and its udp:// one by suite
        after = await admin_get(admin, "/metrics")
        def grew(name: str, **labels: str) -> float:
            return metric(after, name, **labels) - metric(metrics_before, name, **labels)
        assert grew("meshgate_mesh_link_sessions_total", scheme=scheme, aead=ab) == 2
        other = CHACHA if ab == AES else AES
        assert grew("meshgate_mesh_link_sessions_total", scheme=scheme, aead=other) == 0
        assert grew("meshgate_mesh_udp_link_sessions_total", aead=cb) == 2
        # frames really flow under those ciphers: a stream A -> C (both links) and back
        data = os.urandom(4 << 20)
        assert await stream_sha(a, c.node_id, port, data) == hashlib.sha256(data).digest()
        assert await stream_sha(c, a.node_id, port, data[:1 << 20]) == hashlib.sha256(data[:1 << 20]).digest()
    finally:
        srv.close()
        await stop_all([a, c])
        await b_node.stop()


# ------------------------------------------------------------------ an attacker on the path


class Relay:
    """A TCP man in the middle between a dialing node and the node it dials. It knows the network
    secret. `rewrite`: forward every byte, except msg1 with its AEAD offer rewritten to "no AES"
    (the downgrade); `terminate`: run its own handshake with each side (offering no AES, so
    each would settle on ChaCha20-Poly1305) and relay the frames, HELLOs included."""

    def __init__(self, target: tuple[str, int], mode: str) -> None:
        self.target, self.mode = target, mode
        self.psk = derive_psk(NET, SECRET)
        self.established: set[int] = set()  # its codecs that completed a handshake (terminate)
        self.tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    def _client(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        task = asyncio.get_running_loop().create_task(self._serve(r, w))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _serve(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        sr, sw = await asyncio.open_connection(*self.target)
        try:
            if self.mode == "rewrite":
                head = await cr.readexactly(len(PREFACE) + 2)
                body = await cr.readexactly(int.from_bytes(head[-2:], "big"))
                sw.write(rewrite_offer(head + body, bytes((1, 0)), NET))
                await asyncio.gather(self._copy(cr, sw), self._copy(sr, cw))
            else:
                await self._terminate(cr, cw, sr, sw)
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            cw.close()
            sw.close()

    @staticmethod
    async def _copy(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while data := await r.read(65536):
            w.write(data)
            await w.drain()
        w.close()

    async def _terminate(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter,
                         sr: asyncio.StreamReader, sw: asyncio.StreamWriter) -> None:
        # facing the dialer it is the responder, facing the dialed node the initiator; each
        # frame one side sends (the HELLO first) goes out to the other
        to_client = LinkCodec(False, NET, self.psk, lambda *f: to_server.send_frame(*f))
        to_server = LinkCodec(True, NET, self.psk, lambda *f: to_client.send_frame(*f))
        to_server.start()

        def flush() -> None:
            for codec, w in ((to_client, cw), (to_server, sw)):
                if codec.established or not codec.pending_bytes():  # frames wait for its keys
                    w.writelines(codec.data_to_send())
                if codec.established:
                    self.established.add(id(codec))

        async def pump(r: asyncio.StreamReader, codec: LinkCodec) -> None:
            while data := await r.read(65536):
                codec.receive(data)
                flush()

        flush()
        await asyncio.gather(pump(cr, to_client), pump(sr, to_server))


def handshakes(result: str) -> float:
    return REGISTRY.value("meshgate_mesh_handshakes_total", result)


@pytest.mark.parametrize("mode", ["rewrite", "terminate"])
async def test_an_attacker_with_the_network_secret_gets_no_link_up(mode: str) -> None:
    """Both nodes have AES. Rewriting msg1's offer changes the responder's transcript: the
    dialer fails msg2 (failed_handshake) and the dialed node sees it close (failed_closed).
    Terminating both handshakes works at the Noise level (the attacker holds the PSK), but
    each node's HELLO is signed over its own link's handshake hash and names its own key: the
    receivers refuse it (refused_bad_key). Either way no link, of any suite, comes up."""
    b = await start_node(node_config("b", "10.9.6.2/24", listen=["tcp://127.0.0.1:0"],
                                     limits={"aes_instructions": "yes"}))
    host, port = b.listen_addrs[0].removeprefix("tcp://").rsplit(":", 1)
    relay = Relay((host, int(port)), mode)
    relay_port = await relay.start()
    before = {r: handshakes(r) for r in ("failed_handshake", "failed_closed", "refused_bad_key", "ok")}
    a = await start_node(node_config("a", "10.9.6.1/24", peers=[f"tcp://127.0.0.1:{relay_port}"],
                                     limits={"aes_instructions": "yes"}))
    try:
        if mode == "rewrite":
            await async_wait_until(lambda: handshakes("failed_handshake") > before["failed_handshake"]
                                   and handshakes("failed_closed") > before["failed_closed"], 15,
                                   "the dialer to refuse msg2 and the dialed node to see it close")
        else:
            await async_wait_until(lambda: handshakes("refused_bad_key") >= before["refused_bad_key"] + 2,
                                   15, "both nodes to refuse the relayed HELLO")
            assert len(relay.established) >= 2  # the attacker did complete both handshakes itself
        assert handshakes("ok") == before["ok"]
        assert not a.links and not b.links
    finally:
        relay.server.close()
        for t in list(relay.tasks):
            t.cancel()
        await stop_all([a, b])
