"""The network secret of a personal (secret-mode) mesh: how strong one is, and a new one.

Anyone who answers one of a node's dials (a reassigned address in someone's
`mesh.peers`, a hijacked name) receives Noise message 3 of XXpsk3, sealed with
a key mixed from the PSK, and can test guesses of the secret offline. The PSK
is derived with Argon2id (docs/PROTOCOL.md section 1), so each guess costs tens
of milliseconds and 19 MiB instead of a microsecond; what stays out of reach
is only a secret with enough entropy. `meshgate secret new` makes one of 256
random bits; check-config warns about secrets estimated below `WEAK_BITS`.
"""

from __future__ import annotations

import math
import secrets
import string

WEAK_BITS = 64  # below this an offline guesser with a GPU farm is a realistic threat
NEW_SECRET_BYTES = 32  # 256 bits


def new_secret() -> str:
    """A random secret, URL-safe base64 (43 characters): safe in TOML, env files and shells."""
    return secrets.token_urlsafe(NEW_SECRET_BYTES)


def estimated_bits(secret: str) -> float:
    """A rough upper bound on the secret's entropy: length times log2 of the alphabet its
    character classes span, with repeated characters counted at most twice over the distinct
    ones (so "aaaaaaaaaaaa" is weak). It cannot see dictionary words: a long phrase of common
    words scores higher than it deserves, which is why the warning names `secret new`."""
    if not secret:
        return 0.0
    pool = 0
    if any(c in string.ascii_lowercase for c in secret):
        pool += 26
    if any(c in string.ascii_uppercase for c in secret):
        pool += 26
    if any(c in string.digits for c in secret):
        pool += 10
    if any(c in string.punctuation or c == " " for c in secret):
        pool += 33
    if any(not c.isascii() for c in secret):
        pool += 100
    length = min(len(secret), 2 * len(set(secret)))
    return length * math.log2(max(pool, 2))
