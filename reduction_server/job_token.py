"""What the job token (RS_JOB_TOKEN) stands for, derived once per process: the stretched key that
every proof of it is made with (wire/auth.py, wire/gate.py), and the id of a job known only by
its token (config/discovery.py).

Anyone who reaches a reducer can have it prove the token over a nonce of their choosing, and then
guess the token offline against that proof; the job id travels in clear in every header. So
both come from the token stretched with scrypt (about 30 ms and 16 MiB once per token and
process): each guess costs an attacker that much too, where a plain hash would cost a
microsecond. A token should be random anyway (`reduction-server run` makes one of 128 bits).
"""

from __future__ import annotations

import functools
import hashlib
import hmac

_STRETCH_SALT = b"reduction-server job token v2"
_JOB_ID_LABEL = b"reduction-server job id v1\0"


@functools.lru_cache(maxsize=16)
def key(token: str) -> bytes:
    """The token stretched, the key of every HMAC made with it: each offline guess costs scrypt's work."""
    return hashlib.scrypt(token.encode(), salt=_STRETCH_SALT, n=1 << 14, r=8, p=1, dklen=32)


def job_id(token: str) -> int:
    """The job id a token stands for where no RS_JOB_ID or platform job id names the job: the
    first 8 bytes (big-endian) of HMAC-SHA256 under the stretched token, 0 without a token.
    Every process of the job derives the same, alone (docs/protocol.md, "Handshake")."""
    if not token:
        return 0
    return int.from_bytes(hmac.new(key(token), _JOB_ID_LABEL, hashlib.sha256).digest()[:8], "big")
