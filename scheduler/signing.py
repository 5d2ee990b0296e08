"""How a webhook is signed, and how a receiver checks it (pure: no I/O, the clock a parameter).

Stripe's scheme, which receivers already know: the header `X-Sdfarm-Signature: t=T,v1=HEX`,
where T is the Unix time of signing and HEX the HMAC-SHA256, keyed with the farm's webhook
secret ($SDFARM_WEBHOOK_SECRET), of `T.` followed by the exact body bytes. Signing the time
with the body lets a receiver refuse a captured request replayed later (`tolerance_s`);
signing the bytes, not a parsed document, means the receiver must verify before it parses.
Several `v1=` entries may be present (a farm rotating its secret signs with both), and a
receiver may hold several secrets; one match is enough. Comparisons are constant-time.

The receiver's entry point is `sdfarm.client.webhooks.verify`; this module lives with the
scheduler, which signs, so that the farm's lower stages never import the client.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable, Iterable, Mapping

SIGNATURE_HEADER = "X-Sdfarm-Signature"
DELIVERY_HEADER = "X-Sdfarm-Delivery"
EVENT_HEADER = "X-Sdfarm-Event"
SCHEME = "v1"
DEFAULT_TOLERANCE_S = 300.0
"""How old (or how far in the future) a signature may be: Stripe's five minutes, long enough
for clock skew and a slow receiver, short enough that a replay soon stops verifying."""


class WebhookSignatureError(ValueError):
    """A webhook whose signature is missing, malformed, stale or wrong: do not trust it."""


def _key(secret: str | bytes) -> bytes:
    key = secret.encode() if isinstance(secret, str) else secret
    if not key:
        raise ValueError("the webhook secret is empty")
    return key


def signature(secret: str | bytes, timestamp: int, body: bytes) -> str:
    """The hex HMAC-SHA256 of `timestamp.body` under `secret`."""
    message = str(int(timestamp)).encode() + b"." + body
    return hmac.new(_key(secret), message, hashlib.sha256).hexdigest()


def sign(secret: str | bytes, body: bytes, timestamp: int | None = None) -> str:
    """The value of the signature header for `body`, signed now (or at `timestamp`)."""
    t = int(time.time() if timestamp is None else timestamp)
    return f"t={t},{SCHEME}={signature(secret, t, body)}"


def parse_header(value: str) -> tuple[int, list[str]]:
    """(timestamp, the v1 signatures) of a signature header; WebhookSignatureError when it
    has no timestamp or no v1 signature. Unknown schemes are ignored (a later one may be
    added beside v1)."""
    stamp: int | None = None
    sigs: list[str] = []
    for item in value.split(","):
        name, _, val = item.strip().partition("=")
        if name == "t" and val.isdigit():
            stamp = int(val)
        elif name == SCHEME and val:
            sigs.append(val)
    if stamp is None or not sigs:
        raise WebhookSignatureError(f"malformed {SIGNATURE_HEADER} header: {value[:200]!r}")
    return stamp, sigs


def header(headers: Mapping[str, str] | Iterable[tuple[str, str]], name: str) -> str | None:
    """Header `name` of `headers` (a mapping or (name, value) pairs), case-insensitively."""
    items = headers.items() if isinstance(headers, Mapping) else headers
    want = name.lower()
    for key, value in items:
        if key.lower() == want:
            return value
    return None


def verify(
    secret: str | bytes | Iterable[str | bytes],
    headers: Mapping[str, str] | Iterable[tuple[str, str]],
    body: bytes,
    *,
    tolerance_s: float = DEFAULT_TOLERANCE_S,
    clock: Callable[[], float] = time.time,
) -> int:
    """Check a received webhook: `body` exactly as received, `headers` as received (any
    case), `secret` the farm's (or several, during a rotation). Returns the signed timestamp;
    raises WebhookSignatureError when the header is missing or malformed, the timestamp is
    more than `tolerance_s` from `clock()`, or no signature matches."""
    value = header(headers, SIGNATURE_HEADER)
    if value is None:
        raise WebhookSignatureError(f"no {SIGNATURE_HEADER} header")
    stamp, sigs = parse_header(value)
    if abs(clock() - stamp) > tolerance_s:
        raise WebhookSignatureError(
            f"signed at {stamp}, more than {tolerance_s:g} s from now: a replay or a wrong clock"
        )
    secrets = [secret] if isinstance(secret, str | bytes) else list(secret)
    for key in secrets:
        want = signature(key, stamp, body)
        if any(hmac.compare_digest(want, got) for got in sigs):
            return stamp
    raise WebhookSignatureError("no signature matches: a wrong secret or an altered body")
