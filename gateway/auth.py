"""Who may call the gateway: bearer tokens (compared in constant time), the per-caller rate
limit, the loopback rule of the status page, and the signatures on image URLs that let OpenAI
clients fetch an image without the token.

`Gate` holds the tokens and the limiter (one per app, on `app.state.gate`); the routes use the
dependencies `require_token` and `require_page`, or the gate itself where the rule depends on
the request (a signed image URL).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import math
from collections.abc import Sequence

from fastapi import Request

from sdfarm.gateway.errors import APIError
from sdfarm.gateway.ratelimit import RateLimiter


def _url_key(tokens: Sequence[str]) -> bytes:
    """The key that signs image URLs: derived from the tokens, so replicas of a gateway with
    the same tokens accept each other's URLs."""
    return hashlib.sha256(b"sdfarm-gateway-url\0" + "\0".join(sorted(tokens)).encode()).digest()


class Gate:
    """The tokens (none: an open gateway, limited per client address) and the rate limit."""

    def __init__(self, tokens: Sequence[str], rate_per_minute: float) -> None:
        self.tokens = [t for t in tokens if t]
        self.rate_per_minute = rate_per_minute
        self.limiter = RateLimiter(rate_per_minute)
        self._url_key = _url_key(self.tokens)

    def authorize(self, request: Request) -> None:
        """A valid bearer token, within its rate; APIError 401 or 429 otherwise."""
        if not self.tokens:
            self._limit(request.client.host if request.client else "")
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not given:
            raise APIError(
                401,
                "missing bearer token: send Authorization: Bearer <token>",
                type="authentication_error",
                code="missing_api_key",
            )
        for t in self.tokens:
            if hmac.compare_digest(given.strip().encode(), t.encode()):
                self._limit("token:" + t)
                return
        raise APIError(
            401, "invalid bearer token", type="authentication_error", code="invalid_api_key"
        )

    def authorize_page(self, request: Request) -> None:
        """The status page and its JSON: open to loopback clients, else as the API."""
        host = request.client.host if request.client else ""
        try:
            if ipaddress.ip_address(host).is_loopback:
                return
        except ValueError:
            pass
        self.authorize(request)

    def _limit(self, key: str) -> None:
        wait = self.limiter.take(key)
        if wait > 0:
            raise APIError(
                429,
                f"rate limit: more than {self.rate_per_minute:g} requests a minute; retry in "
                f"{wait:.1f} s",
                type="rate_limit_error",
                code="rate_limited",
                headers={"Retry-After": str(max(1, math.ceil(wait)))},
            )

    def sign(self, job_id: str, i: int) -> str:
        return hmac.new(self._url_key, f"{job_id}:{i}".encode(), hashlib.sha256).hexdigest()[:32]

    def signed(self, job_id: str, i: int, sig: str) -> bool:
        """True when `sig` is this gateway's signature of image `i` of the job (tokens only:
        an open gateway needs none)."""
        return bool(
            self.tokens and sig and hmac.compare_digest(sig.encode(), self.sign(job_id, i).encode())
        )

    def image_url(self, job_id: str, i: int) -> str:
        """The image's path, relative to the gateway's base URL, signed when tokens are on."""
        q = f"i={i}" + (f"&sig={self.sign(job_id, i)}" if self.tokens else "")
        return f"v1/jobs/{job_id}/image.png?{q}"


def gate(request: Request) -> Gate:
    return request.app.state.gate


def require_token(request: Request) -> None:
    """Dependency: a valid bearer token (or, with no tokens, the client's rate)."""
    gate(request).authorize(request)


def require_page(request: Request) -> None:
    """Dependency: a loopback client, or as `require_token`."""
    gate(request).authorize_page(request)
