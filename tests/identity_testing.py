"""A network authority for tests: a CA in a temporary directory, node certificates for
identities, and the node config keys that use them (through meshgate/mesh/authority.py,
as `meshgate ca` does)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from meshgate.mesh import authority, certs
from meshgate.mesh.identity import Identity, public_text


class TestCA:
    __test__ = False  # not a pytest class

    def __init__(self, root: Path, network: str = "testnet", valid: int = 86400) -> None:
        self.root = root
        self.dir = root / f"ca-{network}"
        self.network = network
        self.cert = authority.init(network, self.dir, valid)
        self.revocation_list = root / f"revoked-{network}.list"

    @property
    def ca_file(self) -> str:
        return str(self.dir / authority.CA_CERT)

    def issue(self, name: str, ident: Identity, ip: str, **grants: Any) -> Path:
        """A certificate for `ident` in ROOT/NAME.crt (grants: ip6, cidrs, exit, groups, valid, now)."""
        cert = authority.sign(self.dir, name=name, public=public_text(ident.public), ip=ip, **grants)
        path = self.root / f"{name}-{cert.fingerprint[:8]}.crt"
        path.write_text(certs.armor(certs.CERT_LABEL, cert.raw))
        return path

    def node_keys(self, cert: Path) -> dict[str, Any]:
        """The [node] keys of a node holding `cert`."""
        return {"certificate": str(cert), "ca": self.ca_file, "revocation_list": str(self.revocation_list)}

    def revoke(self, cert: Path, publish: bool = True) -> certs.RevocationList:
        """Revoke in the CA dir; `publish`: copy the list to the file the nodes watch."""
        rl = authority.revoke(self.dir, str(cert))
        if publish:
            tmp = self.revocation_list.with_suffix(".tmp")
            tmp.write_text(certs.armor(certs.REVOCATION_LABEL, rl.raw))
            tmp.replace(self.revocation_list)
        return rl
