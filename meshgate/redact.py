"""The node's effective config as JSON with every secret masked (GET /config, the console).

A secret is a config field declared `field(repr=False)` (node.secret, socks5.users' passwords,
admin.token, an ODoH listener's key_seed) or named like one (secret, password, token, key_seed),
whether it came from the file, a `*_file` (the config keeps only the contents, never shown) or
the environment. A set secret shows as "***", an empty one as "". Credentials in a URL
(`scheme://user:pass@host`) are masked too. Paths (TLS cert/key files) are shown: they are not
the key.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from meshgate.config import Config

MASK = "***"
_SECRET_NAMES = frozenset({"secret", "password", "token", "key_seed", "psk"})
_URL_USERINFO = re.compile(r"(//)[^/@\s]+@")


def _is_secret(f: dataclasses.Field[Any]) -> bool:
    return not f.repr or f.name in _SECRET_NAMES or f.name.endswith(("_secret", "_password", "_token"))


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = dataclasses.fields(value)
        secrets = [f for f in fields if _is_secret(f)]
        if not secrets and type(value).__str__ is not object.__str__:
            return str(value)  # HostPort, LinkUrl, ProxyCidr: their text form, as in the config file
        out: dict[str, Any] = {}
        for f in fields:
            v = getattr(value, f.name)
            out[f.name] = (MASK if v else v) if f in secrets else _plain(v)
        return out
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, str):
        return _URL_USERINFO.sub(r"\1" + MASK + "@", value)
    if value is None or isinstance(value, bool | int | float):
        return value
    return str(value)  # addresses, networks, interfaces


def masked_config(config: Config) -> dict[str, Any]:
    """`config` as a JSON-able dict, secrets masked (see the module docstring)."""
    out = _plain(config)
    assert isinstance(out, dict)
    return out
