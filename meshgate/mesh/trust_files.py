"""Reading the trust files a node is configured with: node.certificate, node.ca,
node.revocation_list, and the newest revocation list the mesh brought (kept in
STATE_DIR/revoked so a restart does not forget it). Errors name the config key
and the file."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from meshgate.config import NodeConfig
from meshgate.errors import StartupError
from meshgate.mesh import certs
from meshgate.mesh.certs import CertError, RevocationList
from meshgate.mesh.identity import Identity, fingerprint
from meshgate.mesh.trust import Trust, own_claims_granted

log = logging.getLogger("meshgate.mesh.trust")

MESH_REVOKED = "revoked"  # in the state dir: the newest list heard from the mesh


def _read(key: str, path: str) -> str:
    try:
        return Path(os.path.expanduser(path)).read_text()
    except OSError as e:
        raise StartupError(f"{key}: cannot read {path}: {e.strerror or e}") from None


def load_trust(node: NodeConfig, identity: Identity, state_dir: Path, now: int) -> Trust:
    if not node.certificate:
        return Trust(node.network)
    cas = []
    for path in node.ca:
        try:
            ca = certs.parse_certificate(certs.dearmor(_read("node.ca", path), certs.CERT_LABEL))
            certs.check_ca(ca, now)
        except CertError as e:
            raise StartupError(f"node.ca: {path}: {e}") from None
        cas.append(ca)
    try:
        own = certs.load_certificate_text(_read("node.certificate", node.certificate))
    except CertError as e:
        raise StartupError(f"node.certificate: {node.certificate}: {e}") from None
    trust = Trust(node.network, tuple(cas), own, require=node.require_certificates)
    try:
        trust.certificate(own.raw, now)
    except CertError as e:
        raise StartupError(f"node.certificate: {node.certificate}: {e}") from None
    if own.public != identity.public:
        raise StartupError(
            f"node.certificate: {node.certificate} was issued for key {fingerprint(own.public)[:16]}…,"
            f" not this node's ({identity.fingerprint[:16]}…, `meshgate key show`)"
        )
    for rl in (read_revocation_list(node.revocation_list), read_mesh_revocation_list(state_dir)):
        if rl is not None:
            trust.adopt(rl)
    try:
        trust.certificate(own.raw, now)
    except CertError as e:
        raise StartupError(f"node.certificate: {node.certificate}: {e}") from None
    return trust


def check_own_claims(trust: Trust, node: NodeConfig, cidrs: tuple[tuple[certs.IPNetwork, bool], ...],
                     exit: bool, dns: tuple[str, ...] = ()) -> None:
    own = trust.own_cert
    if own is None:
        return
    beyond = own_claims_granted(own, node.ipv4, node.ipv6, cidrs, exit, dns)
    if beyond:
        raise StartupError(f"node.certificate: {node.certificate} does not grant " + "; ".join(beyond))


def read_revocation_list(path: str) -> RevocationList | None:
    """The list in node.revocation_list; None when unset or not there yet (a warning if damaged)."""
    if not path:
        return None
    try:
        text = Path(os.path.expanduser(path)).read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("node.revocation_list: cannot read %s: %s", path, e.strerror or e)
        return None
    try:
        return certs.parse_revocation_list(certs.dearmor(text, certs.REVOCATION_LABEL))
    except CertError as e:
        log.warning("node.revocation_list: %s: %s", path, e)
        return None


def read_mesh_revocation_list(state_dir: Path) -> RevocationList | None:
    return read_revocation_list(str(state_dir / MESH_REVOKED))


def store_mesh_revocation_list(state_dir: Path, rl: RevocationList) -> None:
    path = state_dir / MESH_REVOKED
    try:
        state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(certs.armor(certs.REVOCATION_LABEL, rl.raw))
        os.replace(tmp, path)
    except OSError as e:
        log.warning("node.state_dir: cannot keep the revocation list in %s: %s", path, e.strerror or e)


class FileWatch:
    """Tells when a file's (mtime, size, inode) changed since the last look."""

    def __init__(self, path: str) -> None:
        self.path = os.path.expanduser(path) if path else ""
        self._seen: tuple[int, int, int] | None = self._stamp()

    def _stamp(self) -> tuple[int, int, int] | None:
        if not self.path:
            return None
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def changed(self) -> bool:
        stamp = self._stamp()
        if stamp == self._seen:
            return False
        self._seen = stamp
        return stamp is not None
