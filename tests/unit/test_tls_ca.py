"""The node's local CA and the listener certificate it issues (meshgate/tls.py): what each
certificate says, the files' modes, and when the listener certificate is issued again."""

from __future__ import annotations

import datetime
import ipaddress
import logging
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtendedKeyUsageOID

from meshgate import tls
from meshgate.config import from_dict
from meshgate.dns import service
from meshgate.dns.listeners import Listener, listener_class


def _certs(path: Path) -> list[x509.Certificate]:
    return x509.load_pem_x509_certificates(path.read_bytes())


def _sans(cert: x509.Certificate) -> set[str]:
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    ips = {str(v) for v in san.get_values_for_type(x509.IPAddress)}
    return ips | set(san.get_values_for_type(x509.DNSName))


def test_the_ca_is_a_ca_for_this_node_only(tmp_path: Path) -> None:
    state = tmp_path / "state"
    cert_path, key_path = tls.ensure_ca(state, "portal", "mesh.internal.")
    assert (cert_path, key_path) == (state / "ca.crt", state / "ca.key")
    assert oct(key_path.stat().st_mode & 0o777) == "0o600"
    assert oct(state.stat().st_mode & 0o777) == "0o700"
    [ca] = _certs(cert_path)
    assert ca.subject == ca.issuer
    assert "meshgate" in ca.subject.rfc4514_string() and "portal" in ca.subject.rfc4514_string()
    bc = ca.extensions.get_extension_for_class(x509.BasicConstraints)
    assert bc.critical and bc.value.ca and bc.value.path_length == 0
    ku = ca.extensions.get_extension_for_class(x509.KeyUsage).value
    assert ku.key_cert_sign and ku.crl_sign and not ku.digital_signature
    nc = ca.extensions.get_extension_for_class(x509.NameConstraints)
    assert nc.critical and nc.value.permitted_subtrees is not None
    permitted = {str(g.value) for g in nc.value.permitted_subtrees}
    assert {"localhost", "mesh.internal", "127.0.0.0/8", "::1/128", "10.0.0.0/8"} <= permitted
    days = (ca.not_valid_after_utc - ca.not_valid_before_utc).days
    assert 3600 <= days <= 3660
    # Made once: a second call keeps it.
    before = cert_path.read_bytes()
    tls.ensure_ca(state, "portal", "mesh.internal.")
    assert cert_path.read_bytes() == before


def test_the_listener_certificate_is_a_leaf_the_ca_issued(tmp_path: Path) -> None:
    state = tmp_path / "state"
    cert_path, key_path = tls.ensure_listener_cert(state, ["0.0.0.0", "192.168.7.1"], node_name="portal",
                                                   zone="mesh.internal.")
    assert oct(key_path.stat().st_mode & 0o777) == "0o600"
    leaf, ca = _certs(cert_path)  # the leaf, then the CA: servers send the chain
    assert ca == _certs(state / "ca.crt")[0]
    leaf.verify_directly_issued_by(ca)
    assert leaf.issuer == ca.subject
    bc = leaf.extensions.get_extension_for_class(x509.BasicConstraints).value
    assert bc.ca is False
    eku = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.SERVER_AUTH]
    # 0.0.0.0 stands for loopback; the node's name in the zone and localhost always.
    assert _sans(leaf) == {"127.0.0.1", "::1", "192.168.7.1", "localhost", "portal.mesh.internal"}
    assert leaf.not_valid_after_utc - leaf.not_valid_before_utc <= datetime.timedelta(days=398)
    key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    assert key.public_key() == leaf.public_key()


def test_the_certificate_is_issued_again_when_its_names_change(tmp_path: Path) -> None:
    state = tmp_path / "state"
    cert_path, key_path = tls.ensure_listener_cert(state, ["127.0.0.1"], node_name="a")
    first = _certs(cert_path)[0]
    tls.ensure_listener_cert(state, ["127.0.0.1"], node_name="a")
    assert _certs(cert_path)[0] == first  # nothing changed: kept
    key_before = key_path.read_bytes()
    tls.ensure_listener_cert(state, ["127.0.0.1", "10.1.2.3"], node_name="a")
    second = _certs(cert_path)[0]
    assert second.serial_number != first.serial_number
    assert "10.1.2.3" in _sans(second) and "10.1.2.3" not in _sans(first)
    assert key_path.read_bytes() == key_before  # the key is kept, only the certificate is new
    tls.ensure_listener_cert(state, ["127.0.0.1", "10.1.2.3"], node_name="b")  # the node renamed
    third = _certs(cert_path)[0]
    assert "b.mesh.internal" in _sans(third) and "a.mesh.internal" not in _sans(third)


def test_the_certificate_is_issued_again_near_its_expiry(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    state = tmp_path / "state"
    monkeypatch.setattr(tls, "VALID_DAYS", tls.RENEW_DAYS - 1)
    cert_path, _ = tls.ensure_listener_cert(state)
    short = _certs(cert_path)[0]
    monkeypatch.setattr(tls, "VALID_DAYS", 397)
    tls.ensure_listener_cert(state)
    renewed = _certs(cert_path)[0]
    assert renewed.serial_number != short.serial_number
    assert renewed.not_valid_after_utc - datetime.datetime.now(datetime.UTC) > datetime.timedelta(days=390)


def test_a_new_ca_means_a_new_certificate(tmp_path: Path) -> None:
    state = tmp_path / "state"
    cert_path, _ = tls.ensure_listener_cert(state)
    (state / "ca.crt").unlink()
    (state / "ca.key").unlink()
    tls.ensure_listener_cert(state)
    leaf, ca = _certs(cert_path)
    leaf.verify_directly_issued_by(_certs(state / "ca.crt")[0])
    assert ca == _certs(state / "ca.crt")[0]


def test_addresses_outside_the_name_constraints_are_left_out(tmp_path: Path,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, "meshgate.tls"):
        cert_path, _ = tls.ensure_listener_cert(tmp_path, ["192.0.2.10"])
    assert "192.0.2.10" not in _sans(_certs(cert_path)[0])
    assert "192.0.2.10" in caplog.text and "cert and key" in caplog.text
    assert not any(ipaddress.ip_address("192.0.2.10") in ipaddress.ip_network(n) for n in tls.PERMITTED_NETS)


def _listener(tmp_path: Path, listeners: list[dict[str, str]], index: int) -> Listener:
    cfg = from_dict({"node": {"name": "gw", "state_dir": str(tmp_path / "state")},
                     "dns": {"upstreams": ["udp://127.0.0.1:9"], "listener": listeners}})
    lcfg = cfg.dns.listeners[index]
    return listener_class(lcfg.protocol)(cfg, lcfg, service.Pipeline(cfg), index=index)


def test_listeners_share_one_certificate_naming_each_address(tmp_path: Path) -> None:
    listeners = [{"protocol": "doh", "listen": "127.0.0.1:0"}, {"protocol": "dot", "listen": "10.9.9.9:0"},
                 {"protocol": "udp", "listen": "192.168.50.1:0"}]  # plain DNS: no certificate
    doh = _listener(tmp_path, listeners, 0)
    cert, key = doh.tls_files()
    assert Path(cert) == tmp_path / "state" / "dns-selfsigned.crt"
    assert _sans(_certs(Path(cert))[0]) == {"127.0.0.1", "::1", "10.9.9.9", "localhost", "gw.mesh.internal"}
    dot = _listener(tmp_path, listeners, 1)
    assert dot.tls_files() == (cert, key)


def test_a_configured_certificate_wins(tmp_path: Path) -> None:
    own_cert, own_key = tls.ensure_listener_cert(tmp_path / "own")
    listeners = [{"protocol": "doh", "listen": "127.0.0.1:0", "cert": str(own_cert), "key": str(own_key)}]
    doh = _listener(tmp_path, listeners, 0)
    assert doh.tls_files() == (str(own_cert), str(own_key))
    assert not (tmp_path / "state").exists()  # no CA made for it
