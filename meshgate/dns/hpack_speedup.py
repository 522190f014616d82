"""Route hpack's Huffman decoding through meshgate.dns.huffman: `install()`, once per process.

hpack's Decoder calls the module-level `hpack.hpack.decode_huffman` for every Huffman-coded
literal; ours decodes a byte per step instead of a nibble (~3x faster: dnsperf -m doh sends a new
GET path per query, which no memo can help) and fails exactly where hpack's does (see
meshgate/dns/huffman.py, and tests/unit/test_dns_huffman.py, which checks it against hpack's own
on arbitrary input). Rebinding that name routes every hpack Decoder in the process through it:
the DoH/ODoH server's (meshgate/dns/h2server.py installs it when it is imported) and, in the same
process, h2's client-side decoder too (meshgate/dns/h2client.py works the same either way).

This is the one place that patches a third-party module; nothing else in meshgate does.
"""

from __future__ import annotations

import hpack

from meshgate.dns import huffman


def install() -> bool:
    """Patch hpack (idempotent). False if this hpack has no `hpack.hpack.decode_huffman` to
    replace (a version that moved it): then hpack's own decoder stays, and nothing breaks."""
    module = hpack.hpack
    if not hasattr(module, "decode_huffman"):
        return False
    module.decode_huffman = huffman.decode_huffman  # not re-exported by hpack
    return True


def installed() -> bool:
    return getattr(hpack.hpack, "decode_huffman", None) is huffman.decode_huffman
