"""deploy/: the Kubernetes manifests and the systemd unit agree with the configs they carry.

No cluster and no systemd (as PID 1) run here, so both are checked as data: the
manifests against the Kubernetes OpenAPI schemas bundled in kubernetes-validate
(offline), every TOML they embed through meshgate.config, and each port, mount
path and probe against that config; the unit with configparser against the
options docs/OPERATIONS.md recommends and against deploy/systemd/node.toml.
"""

from __future__ import annotations

import configparser
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from meshgate.admin import check_request
from meshgate.config import DNS_LISTENER_KINDS, Config, ConfigError, from_dict
from meshgate.netfmt import is_loopback
from tests.helpers import require_module

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
UNIT = ROOT / "deploy" / "systemd" / "meshgate@.service"
UNIT_CONFIG = ROOT / "deploy" / "systemd" / "node.toml"
MANIFESTS = sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
# the oldest and the newest Kubernetes whose schemas kubernetes-validate bundles
K8S_VERSIONS = ("1.25.0", "1.37.0")
MIB = 1 << 20


def docs() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for path in MANIFESTS:
        out += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return out


def find(kind: str, name: str) -> dict[str, Any]:
    hits = [d for d in docs() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(hits) == 1, f"{kind}/{name}: {len(hits)} found"
    return hits[0]


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


def container(workload: dict[str, Any]) -> dict[str, Any]:
    containers = pod_spec(workload)["containers"]
    assert len(containers) == 1
    c: dict[str, Any] = containers[0]
    return c


def mounts(workload: dict[str, Any]) -> dict[str, str]:
    return {m["name"]: m["mountPath"] for m in container(workload)["volumeMounts"]}


def volumes(workload: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in pod_spec(workload).get("volumes", [])}


def embedded_config(workload: dict[str, Any], tmp_path: Path) -> tuple[dict[str, Any], Config]:
    """The TOML the workload runs (-c PATH in its args, from its ConfigMap volume), raw and loaded.
    Loaded as the pod would, except the secret: node.secret_file points at a temp file."""
    args = container(workload)["args"]
    assert args[:2] == ["run", "-c"]
    path = Path(args[2])
    config_volume = next(n for n, m in mounts(workload).items() if m == str(path.parent))
    cm_name = volumes(workload)[config_volume]["configMap"]["name"]
    raw = tomllib.loads(find("ConfigMap", cm_name)["data"][path.name])
    secret = tmp_path / "secret"
    secret.write_text("k8s-test-secret-0123456789abcdef\n")
    loaded = dict(raw)
    loaded["node"] = {**raw["node"], "secret_file": str(secret)}
    return raw, from_dict(loaded)


def container_ports(workload: dict[str, Any]) -> dict[str, tuple[int, str]]:
    return {p["name"]: (p["containerPort"], p.get("protocol", "TCP")) for p in container(workload)["ports"]}


def service_targets(service: dict[str, Any], workload: dict[str, Any]) -> set[tuple[int, str]]:
    """(container port, protocol) each Service port reaches, by name or number."""
    named = container_ports(workload)
    out = set()
    for p in service["spec"]["ports"]:
        target = p.get("targetPort", p["port"])
        port, proto = named[target] if isinstance(target, str) else (target, p.get("protocol", "TCP"))
        assert proto == p.get("protocol", "TCP"), f"{service['metadata']['name']}: {p['name']} protocol"
        out.add((port, proto))
    return out


def selects(service: dict[str, Any], workload: dict[str, Any]) -> bool:
    labels = workload["spec"]["template"]["metadata"]["labels"]
    return all(labels.get(k) == v for k, v in service["spec"]["selector"].items())


def quantity(text: str | int) -> float:
    """A Kubernetes quantity: "100m" CPUs, "96Mi" bytes, "2"."""
    s = str(text)
    units = {"m": 1e-3, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}
    for suffix, factor in units.items():
        if s.endswith(suffix):
            return float(s[: -len(suffix)]) * factor
    return float(s)


# --------------------------------------------------------------------------- Kubernetes


def test_manifests_exist_and_kustomization_lists_them() -> None:
    assert {p.name for p in MANIFESTS} == {"namespace.yaml", "node.yaml", "dns.yaml"}
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kust["resources"]) == sorted(p.name for p in MANIFESTS)
    assert all(d["metadata"].get("namespace", kust["namespace"]) == kust["namespace"] for d in docs())


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_manifests_match_the_kubernetes_schemas(version: str) -> None:
    kv = require_module("kubernetes_validate")
    kinds = []
    for d in docs():
        kv.validate(d, version, strict=True)  # strict: unknown fields fail too
        kinds.append(d["kind"])
    assert sorted(kinds) == sorted(
        ["Namespace", "ConfigMap", "Service", "Service", "StatefulSet", "ConfigMap", "Service", "Deployment"]
    )


def test_the_validator_catches_mistakes() -> None:
    kv = require_module("kubernetes_validate")
    sts = find("StatefulSet", "meshgate")
    bad = yaml.safe_load(yaml.safe_dump(sts))
    pod_spec(bad)["containers"][0]["readinessprobe"] = {}  # misspelt: would be ignored by a lax check
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, K8S_VERSIONS[-1], strict=True)


def test_node_statefulset(tmp_path: Path) -> None:
    sts = find("StatefulSet", "meshgate")
    raw, cfg = embedded_config(sts, tmp_path)
    # state on the volumeClaimTemplate, mounted at node.state_dir
    claims = {c["metadata"]["name"] for c in sts["spec"]["volumeClaimTemplates"]}
    assert "state" in claims and "state" not in volumes(sts)
    assert mounts(sts)["state"] == cfg.node.state_dir
    # the mesh link port, tcp and udp, on every address of the pod
    links = {(u.port, {"tcp": "TCP", "udp": "UDP", "quic": "UDP"}[u.scheme]) for u in cfg.mesh.listen}
    assert links == {(11010, "TCP"), (11010, "UDP")}
    assert all(u.host == "0.0.0.0" for u in cfg.mesh.listen)
    assert set(container_ports(sts).values()) == links
    for name in ("meshgate", "meshgate-peers"):
        svc = find("Service", name)
        assert selects(svc, sts)
        assert service_targets(svc, sts) == links
    headless = find("Service", "meshgate-peers")
    assert headless["spec"]["clusterIP"] == "None" and sts["spec"]["serviceName"] == "meshgate-peers"
    assert not cfg.tun.enable and raw["node"].get("name") is None  # the name is the pod's (--name)
    # one virtual IP in a ConfigMap every replica reads: one replica
    assert cfg.node.ipv4 is not None and sts["spec"]["replicas"] == 1


def test_dns_deployment(tmp_path: Path) -> None:
    dep = find("Deployment", "meshgate-dns")
    _raw, cfg = embedded_config(dep, tmp_path)
    assert mounts(dep)["state"] == cfg.node.state_dir and "emptyDir" in volumes(dep)["state"]
    # the DoH/DoT/plain listeners, on every address of the pod, are the container's ports
    protocols = {lst.protocol for lst in cfg.dns.listeners}
    assert protocols == {"doh", "dot", "udp", "tcp"}
    socket_of = {lst.protocol: DNS_LISTENER_KINDS[lst.protocol].socket.upper() for lst in cfg.dns.listeners}
    listening = {(lst.listen.port, socket_of[lst.protocol]) for lst in cfg.dns.listeners}
    assert all(lst.listen.host == "0.0.0.0" for lst in cfg.dns.listeners)
    assert set(container_ports(dep).values()) == listening
    # the Service offers each protocol on its standard port
    svc = find("Service", "meshgate-dns")
    assert selects(svc, dep) and service_targets(svc, dep) == listening
    named = container_ports(dep)
    for p in svc["spec"]["ports"]:
        port, proto = named[p["targetPort"]]
        (protocol,) = {
            lst.protocol for lst in cfg.dns.listeners
            if lst.listen.port == port and socket_of[lst.protocol] == proto
        }
        assert p["port"] == DNS_LISTENER_KINDS[protocol].default_port, p["name"]
    # TLS from the meshgate-dns-tls Secret (kubernetes.io/tls keys), shared by every replica
    tls_dir = mounts(dep)["tls"]
    assert volumes(dep)["tls"]["secret"]["secretName"] == "meshgate-dns-tls"
    for lst in cfg.dns.listeners:
        if lst.protocol in ("doh", "dot"):
            assert (lst.cert, lst.key) == (f"{tls_dir}/tls.crt", f"{tls_dir}/tls.key")
    # each replica joins the mesh through the StatefulSet's first pod, by its stable name
    sts = find("StatefulSet", "meshgate")
    ns = sts["metadata"]["namespace"]
    (peer,) = cfg.mesh.peers
    assert peer.host == f"{sts['metadata']['name']}-0.{sts['spec']['serviceName']}.{ns}.svc.cluster.local"
    assert (peer.scheme, peer.port) == ("tcp", 11010)


def test_dns_workers_match_the_cpu_limit(tmp_path: Path) -> None:
    dep = find("Deployment", "meshgate-dns")
    raw, cfg = embedded_config(dep, tmp_path)
    # "auto" would be the machine's CPU count, not the container's limit
    assert isinstance(raw["dns"]["workers"], int) and cfg.dns.workers > 1
    assert quantity(container(dep)["resources"]["limits"]["cpu"]) == cfg.dns.workers


@pytest.mark.parametrize("kind,name", [("StatefulSet", "meshgate"), ("Deployment", "meshgate-dns")])
def test_secret_comes_from_a_mounted_secret(kind: str, name: str, tmp_path: Path) -> None:
    workload = find(kind, name)
    raw, _cfg = embedded_config(workload, tmp_path)
    assert "secret" not in raw["node"]  # never a literal in the ConfigMap
    secret_file = Path(raw["node"]["secret_file"])
    vol = next(n for n, m in mounts(workload).items() if m == str(secret_file.parent))
    assert volumes(workload)[vol]["secret"]["secretName"] == "meshgate-secret"
    assert secret_file.name == "secret"  # the key: kubectl create secret generic ... --from-file=secret=
    assert not (volumes(workload)[vol]["secret"]).get("items")
    # no secret in the environment: every variable comes from the pod's own fields
    for env in container(workload).get("env", []):
        assert "value" not in env and set(env["valueFrom"]) == {"fieldRef"}, env["name"]
    assert "$(POD_NAME)" in container(workload)["args"]
    assert not any(d["kind"] == "Secret" for d in docs())


@pytest.mark.parametrize("kind,name", [("StatefulSet", "meshgate"), ("Deployment", "meshgate-dns")])
def test_probes_use_the_admin_api_on_loopback(kind: str, name: str, tmp_path: Path) -> None:
    workload = find(kind, name)
    _raw, cfg = embedded_config(workload, tmp_path)
    assert cfg.admin.enable and is_loopback(cfg.admin.listen.host) and not cfg.admin.token
    for probe in ("readinessProbe", "livenessProbe"):
        command = container(workload)[probe]["exec"]["command"]
        assert command == ["meshgate", "status", "--admin", str(cfg.admin.listen)], probe
    # the admin port is no container port: nothing outside the pod reaches it
    assert cfg.admin.listen.port not in {p for p, _ in container_ports(workload).values()}


def test_kubelet_http_probe_would_pass_the_host_check_but_not_the_token() -> None:
    """Why the probes are exec: kubelet's httpGet sends Host: <pod IP>:<port>, which the
    DNS-rebinding check accepts, but it comes from off loopback, where a configured
    admin.token is required, and httpHeaders cannot take the token from a Secret."""
    for host in ("10.244.1.7:15888", "[fd00:10:244::7]:15888"):
        head = f"GET /status HTTP/1.1\r\nHost: {host}\r\nUser-Agent: kube-probe/1.30\r\n\r\n".encode()
        assert check_request(head, (), "", need_token=False) == (0, "/status")
        assert check_request(head, (), "t" * 16, need_token=True) == (401, "/status")
    named = b"GET /status HTTP/1.1\r\nHost: meshgate-0.meshgate-peers\r\n\r\n"
    assert check_request(named, (), "", need_token=False)[0] == 403


@pytest.mark.parametrize("kind,name", [("StatefulSet", "meshgate"), ("Deployment", "meshgate-dns")])
def test_security_context(kind: str, name: str) -> None:
    workload = find(kind, name)
    pod = pod_spec(workload)["securityContext"]
    uid = int(re.search(r"--uid (\d+)", (ROOT / "Dockerfile").read_text()).group(1))  # type: ignore[union-attr]
    assert pod["runAsNonRoot"] is True and pod["runAsUser"] == uid and pod["fsGroup"] == pod["runAsGroup"]
    assert pod["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = container(workload)["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}  # NET_ADMIN only as a comment (TUN)
    assert pod_spec(workload)["automountServiceAccountToken"] is False
    assert all(not p[0] < 1024 for p in container_ports(workload).values())  # no NET_BIND_SERVICE


@pytest.mark.parametrize(
    "kind,name,need_mib",
    [
        # docs/OPERATIONS.md: 41-49 MiB peak RSS per node (bench/portal.py) + 20 MiB Argon2id at start
        ("StatefulSet", "meshgate", 49 + 20),
        # docs/OPERATIONS.md, DNS worker processes: peak RSS 125 MiB for two processes
        ("Deployment", "meshgate-dns", 125),
    ],
)
def test_resources_are_sized_from_the_measured_figures(kind: str, name: str, need_mib: int) -> None:
    res = container(find(kind, name))["resources"]
    probe_mib = 25  # one `meshgate status` process (measured with /usr/bin/time, 2026-12-01)
    req, lim = res["requests"], res["limits"]
    assert quantity(req["memory"]) >= (need_mib + probe_mib) * MIB
    assert quantity(lim["memory"]) >= 2 * quantity(req["memory"])
    assert quantity(req["cpu"]) <= quantity(lim["cpu"])


def test_namespace_enforces_the_restricted_pod_security_standard() -> None:
    ns = find("Namespace", "meshgate")
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


# --------------------------------------------------------------------------- systemd


def unit() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # systemd keys are case-sensitive
    parser.read_string(UNIT.read_text())
    return parser


def unit_config(tmp_path: Path, instance: str = "node") -> tuple[dict[str, Any], Config]:
    raw = tomllib.loads(UNIT_CONFIG.read_text())
    secret = tmp_path / "secret"
    secret.write_text("unit-test-secret-0123456789abcdef\n")
    return raw, from_dict({**raw, "node": {**raw["node"], "secret_file": str(secret)}})


def test_unit_runs_one_node_per_config() -> None:
    svc = unit()["Service"]
    assert svc["ExecStart"].split() == ["/usr/local/bin/meshgate", "run", "-c", "/etc/meshgate/%i.toml"]
    assert svc["ExecStartPre"].split() == ["/usr/local/bin/meshgate", "check-config", "/etc/meshgate/%i.toml"]
    assert unit()["Install"]["WantedBy"] == "multi-user.target"


def test_unit_hardening() -> None:
    svc = unit()["Service"]
    expected = {
        "DynamicUser": "yes",
        "StateDirectory": "meshgate/%i",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "NoNewPrivileges": "yes",
        "CapabilityBoundingSet": "",
        "AmbientCapabilities": "",
        "SystemCallFilter": "@system-service",
        "LoadCredential": "secret:/etc/meshgate/%i.secret",
    }
    assert {k: svc.get(k) for k in expected} == expected
    assert set(svc["RestrictAddressFamilies"].split()) == {"AF_INET", "AF_INET6", "AF_UNIX", "AF_NETLINK"}


def test_unit_and_its_config_agree(tmp_path: Path) -> None:
    svc = unit()["Service"]
    raw, cfg = unit_config(tmp_path)
    instance = UNIT_CONFIG.stem  # /etc/meshgate/node.toml is meshgate@node
    assert cfg.node.name == instance
    assert cfg.node.state_dir == "/var/lib/" + svc["StateDirectory"].replace("%i", instance)
    credential = svc["LoadCredential"].split(":", 1)[0]
    assert raw["node"]["secret_file"] == f"/run/credentials/meshgate@{instance}.service/{credential}"
    # no capabilities: no TUN and no port below 1024
    assert not cfg.tun.enable
    ports = [u.port for u in cfg.mesh.listen] + [cfg.socks5.listen.port, cfg.admin.listen.port]
    ports += [lst.listen.port for lst in cfg.dns.listeners]
    assert min(ports) >= 1024


def test_secret_file_is_not_expanded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Why the unit's config names /run/credentials/<unit>/secret: meshgate expands ~ in
    node.secret_file, not $CREDENTIALS_DIRECTORY."""
    (tmp_path / "secret").write_text("unit-test-secret-0123456789abcdef\n")
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(tmp_path))
    with pytest.raises(ConfigError, match=r"node\.secret_file"):
        from_dict({"node": {"secret_file": "$CREDENTIALS_DIRECTORY/secret"}})


def systemd_section() -> str:
    text = (ROOT / "docs" / "OPERATIONS.md").read_text()
    start = text.index("### systemd")
    return text[start : text.index("\n### ", start + 1)]


def test_operations_md_recommends_what_the_unit_sets() -> None:
    """Every `Key=value` docs/OPERATIONS.md's systemd section names is in the unit, as named."""
    svc = unit()["Service"]
    named = re.findall(r"`([A-Z][A-Za-z]+)=([^`]*)`", systemd_section())
    keys = {k for k, _ in named}
    assert {"ProtectSystem", "ProtectHome", "PrivateTmp", "NoNewPrivileges", "CapabilityBoundingSet",
            "RestrictAddressFamilies", "SystemCallFilter", "LoadCredential", "StateDirectory"} <= keys
    commented = {ln.lstrip("# ").split("=", 1)[0] for ln in UNIT.read_text().splitlines()
                 if re.match(r"#\s+[A-Z][A-Za-z]+=", ln)}
    for key, value in named:
        if key in svc:
            assert svc[key] == value, key
        else:
            assert key in commented, f"{key} is named in OPERATIONS.md but neither set nor shown in the unit"
