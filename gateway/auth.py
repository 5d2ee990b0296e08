"""Who may call the gateway, and what they may see: bearer tokens (compared in constant time),
operator tokens, the owner of a job, the per-caller rate limit, the client's real address
behind trusted proxies, the status page's session cookie, and the signatures on image URLs that
let OpenAI clients fetch an image without the token (and on video URLs, which also expire).

`Gate` holds all of it (one per app, on `app.state.gate`). The routes use the dependencies
`require_token` and `require_page`, which leave the `Caller` on `request.state.caller`, or the
gate itself where the rule depends on the request (a signed image URL).

The rules:

- No token configured (the gateway then serves only on loopback, `sdfarm.gateway.cli`):
  everything is open, as one farm-wide view; each client address gets the rate limit.
- Tokens configured: every endpoint but /healthz needs `Authorization: Bearer <token>` (or
  HTTP Basic with the token as the password, as A1111 clients send it), the
  status page and its JSON too, loopback clients included (a browser gets a session cookie
  from `GET /?token=<token>`: `session_cookie`). A job submitted with a token records the
  token's fingerprint as its owner (`fingerprint`, never the token); a normal token sees and
  cancels only its own jobs (another owner's job answers 404, as an unknown one); an operator
  token sees everything.
- A token may have at most `job_quota` live jobs (queued, placed or running) when one is set;
  the farm's Redis counts them, so every replica agrees (Store.submit refuses atomically).
- The rate limit is keyed on the authenticated token, else on the client's address; a failed
  authentication counts against that address. The address is the TCP peer, or, when the peer
  is a trusted proxy (`trusted_proxies`), the nearest untrusted address X-Forwarded-For names.
  Its counts live in the farm's Redis (sdfarm.gateway.ratelimit), so replicas share one limit.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from fastapi import Request

from sdfarm.gateway.errors import APIError
from sdfarm.gateway.ratelimit import MEMORY, RateLimiter
from sdfarm.store.results import SIGNED_URL_S

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
SESSION_COOKIE = "sdfarm_session"
SESSION_TTL_S = 12 * 3600
MISSING = "missing bearer token: send Authorization: Bearer <token>"


def fingerprint(token: str) -> str:
    """What a job records as its owner for `token`: the first 16 hex digits of its sha256."""
    return hashlib.sha256(token.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Caller:
    """Who made a request: `owner` is what a job it submits records ("" on an open gateway);
    `sees_all`: an operator token, or an open gateway."""

    owner: str
    sees_all: bool

    def may_see(self, owner: str) -> bool:
        return self.sees_all or (bool(self.owner) and owner == self.owner)


OPEN = Caller("", True)


def _url_key(tokens: Iterable[str]) -> bytes:
    """The key that signs image URLs and sessions: derived from the tokens, so replicas of a
    gateway with the same tokens accept each other's URLs."""
    return hashlib.sha256(b"sdfarm-gateway-url\0" + "\0".join(sorted(tokens)).encode()).digest()


def parse_networks(values: Iterable[str]) -> list[IPNetwork]:
    """CIDRs (or single addresses) as networks; ValueError names a bad one."""
    out = []
    for v in values:
        try:
            out.append(ipaddress.ip_network(v.strip(), strict=False))
        except ValueError:
            raise ValueError(f"not an address or CIDR: {v!r}") from None
    return out


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """An address as X-Forwarded-For or a peer writes it ("1.2.3.4", "[::1]:80", "::1")."""
    text = text.strip()
    if text.startswith("["):
        text = text[1:].partition("]")[0]
    elif text.count(":") == 1:  # IPv4 with a port
        text = text.partition(":")[0]
    try:
        addr = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


class Gate:
    """The tokens (none: an open gateway, limited per client address), the operator tokens,
    the trusted proxies and the rate limit, counted in `rate_storage` (a Redis URL: shared by
    every gateway on it; MEMORY: this process only), `job_quota`: the live jobs a token
    may have at once (0: no limit; kept in the farm's Redis, sdfarm.store's `owned:` sets),
    and `url_ttl_s`: how long a signed video URL lasts (an S3 store's presigned URL's hour)."""

    def __init__(
        self,
        tokens: Sequence[str],
        rate_per_minute: float,
        *,
        operator_tokens: Sequence[str] = (),
        trusted_proxies: Sequence[str] = (),
        rate_storage: str = MEMORY,
        job_quota: int = 0,
        url_ttl_s: int = SIGNED_URL_S,
    ) -> None:
        operators = [t for t in operator_tokens if t]
        normal = [t for t in tokens if t and t not in operators]
        self._tokens: list[tuple[bytes, Caller]] = [
            (t.encode(), Caller(fingerprint(t), False)) for t in normal
        ] + [(t.encode(), Caller(fingerprint(t), True)) for t in operators]
        self._by_owner = {c.owner: c for _, c in self._tokens}
        self.rate_per_minute = rate_per_minute
        self.limiter = RateLimiter(rate_per_minute, rate_storage)
        self.job_quota = max(0, job_quota)
        self.trusted = parse_networks(trusted_proxies)
        self._url_key = _url_key([*normal, *operators])
        self.url_ttl_s = url_ttl_s

    @property
    def tokens_on(self) -> bool:
        return bool(self._tokens)

    # -- who is calling ----------------------------------------------------------------------

    def client_address(self, request: Request) -> str:
        """The client's address: the TCP peer, unless that is a trusted proxy: then the
        nearest address X-Forwarded-For names that is not a trusted proxy (read from the
        right: each proxy appends the address it heard from)."""
        peer = request.client.host if request.client else ""
        addr = _ip(peer)
        if addr is None or not self._trusted(addr):
            return peer
        hops = [h for v in request.headers.getlist("x-forwarded-for") for h in v.split(",")]
        for hop in reversed(hops):
            got = _ip(hop)
            if got is None:  # garbage: stop at the last address a trusted proxy vouched for
                break
            addr = got
            if not self._trusted(addr):
                break
        return str(addr)

    def _trusted(self, addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
        return any(addr.version == n.version and addr in n for n in self.trusted)

    def _token_caller(self, given: str) -> Caller | None:
        found = None
        raw = given.encode()
        for t, caller in self._tokens:  # every token compared: the time says nothing
            if hmac.compare_digest(raw, t):
                found = caller
        return found

    async def authorize(self, request: Request, *, cookie: bool = False) -> Caller:
        """The Caller of a request with a valid bearer token (or, with `cookie`, a valid
        session cookie) within its rate, or of any request on an open gateway; APIError 401
        or 429 otherwise. A failed authentication counts against the client's address."""
        if not self.tokens_on:
            await self._limit("addr:" + self.client_address(request))
            return OPEN
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        caller = None
        if scheme.lower() == "bearer" and given.strip():
            caller = self._token_caller(given.strip())
            code, why = "invalid_api_key", "invalid bearer token"
        elif scheme.lower() == "basic" and given.strip():
            caller = self._token_caller(basic_password(given.strip()))
            code, why = "invalid_api_key", "invalid token (HTTP Basic: the password is the token)"
        else:
            code, why = "missing_api_key", MISSING
            session = request.cookies.get(SESSION_COOKIE) if cookie else None
            if session:
                caller = self.session_caller(session)
                code, why = "invalid_api_key", "invalid or expired session: sign in again"
        if caller is None:
            await self._limit("addr:" + self.client_address(request))
            raise APIError(401, why, type="authentication_error", code=code)
        await self._limit("token:" + caller.owner)
        return caller

    async def _limit(self, key: str) -> None:
        wait = await self.limiter.take(key)
        if wait > 0:
            raise APIError(
                429,
                f"rate limit: more than {self.rate_per_minute:g} requests a minute; retry in "
                f"{wait:.1f} s",
                type="rate_limit_error",
                code="rate_limited",
                headers={"Retry-After": str(max(1, math.ceil(wait)))},
            )

    # -- the status page's session -------------------------------------------------------------

    async def token_caller(self, request: Request, token: str) -> Caller:
        """The Caller of `token` given by hand (the status page's sign-in), counted as an
        authentication; APIError 401 or 429 otherwise."""
        caller = self._token_caller(token) if token else None
        if caller is None:
            await self._limit("addr:" + self.client_address(request))
            raise APIError(
                401, "invalid token", type="authentication_error", code="invalid_api_key"
            )
        await self._limit("token:" + caller.owner)
        return caller

    def session_cookie(self, caller: Caller, now: float | None = None) -> str:
        """A cookie value that stands for `caller` for SESSION_TTL_S: its fingerprint, the
        expiry and this gateway's signature of both (never the token)."""
        expires = int((time.time() if now is None else now) + SESSION_TTL_S)
        return f"{caller.owner}.{expires}.{self._sign(f'session:{caller.owner}:{expires}')}"

    def session_caller(self, value: str, now: float | None = None) -> Caller | None:
        owner, _, rest = value.partition(".")
        expires, _, sig = rest.partition(".")
        caller = self._by_owner.get(owner)
        if caller is None or not expires.isdigit() or not sig:
            return None
        if int(expires) < (time.time() if now is None else now):
            return None
        good = self._sign(f"session:{owner}:{expires}")
        return caller if hmac.compare_digest(sig.encode(), good.encode()) else None

    # -- signed image URLs ---------------------------------------------------------------------

    def _sign(self, text: str) -> str:
        return hmac.new(self._url_key, text.encode(), hashlib.sha256).hexdigest()[:32]

    def sign(self, job_id: str, i: int) -> str:
        return self._sign(f"{job_id}:{i}")

    def signed(self, job_id: str, i: int, sig: str) -> bool:
        """True when `sig` is this gateway's signature of image `i` of the job (tokens only:
        an open gateway needs none)."""
        return bool(
            self.tokens_on
            and sig
            and hmac.compare_digest(sig.encode(), self.sign(job_id, i).encode())
        )

    def image_url(self, job_id: str, i: int) -> str:
        """The image's path, relative to the gateway's base URL, signed when tokens are on."""
        q = f"i={i}" + (f"&sig={self.sign(job_id, i)}" if self.tokens_on else "")
        return f"v1/jobs/{job_id}/image.png?{q}"

    # -- signed video URLs, which expire ---------------------------------------------------------

    def _video_sig(self, job_id: str, fmt: str, expires: int) -> str:
        return self._sign(f"video:{job_id}:{fmt}:{expires}")

    def video_url(self, job_id: str, fmt: str, now: float | None = None) -> tuple[str, int | None]:
        """(the video file's path relative to the gateway's base URL, its expiry as Unix
        time): signed for `url_ttl_s` from `now` when tokens are on (fetchable without the
        token until then); unsigned, with no expiry, on an open gateway. The signature covers
        the job, the format and the expiry, so none of them can be changed."""
        path = f"v1/jobs/{job_id}/video.{fmt}"
        if not self.tokens_on:
            return path, None
        expires = int((time.time() if now is None else now) + self.url_ttl_s)
        return f"{path}?exp={expires}&sig={self._video_sig(job_id, fmt, expires)}", expires

    def video_signature(
        self, job_id: str, fmt: str, expires: int, sig: str, now: float | None = None
    ) -> str:
        """What a video URL's `exp` and `sig` are: "valid", "expired" (this gateway's own
        signature, past its time: the URL was genuine, so saying so leaks nothing) or
        "invalid" (no signature, a wrong one, or an open gateway, which needs none)."""
        if not (self.tokens_on and sig):
            return "invalid"
        good = self._video_sig(job_id, fmt, expires)
        if not hmac.compare_digest(sig.encode(), good.encode()):
            return "invalid"
        return "expired" if expires < (time.time() if now is None else now) else "valid"


def basic_password(credentials: str) -> str:
    """The password of HTTP Basic credentials ("" when malformed): A1111 clients send their
    `--api-auth user:password` that way, and the gateway reads the password as the token."""
    try:
        text = base64.b64decode(credentials, validate=True).decode("utf-8")
    except (ValueError, UnicodeDecodeError):
        return ""
    return text.partition(":")[2]


def gate(request: Request) -> Gate:
    return request.app.state.gate


def job_quota(request: Request) -> int:
    """The live-jobs quota of the request's caller: the gate's, for a token; none (0) on an
    open gateway, whose callers have no owner to count for."""
    return gate(request).job_quota if caller(request).owner else 0


def caller(request: Request) -> Caller:
    """The Caller a dependency authorized (an open gateway's when none ran)."""
    return getattr(request.state, "caller", OPEN)


async def require_token(request: Request) -> None:
    """Dependency: a valid bearer token (or, with no tokens, the client's rate). Async: it
    reads nothing, so it needs no thread of the pool."""
    request.state.caller = await gate(request).authorize(request)


async def require_page(request: Request) -> None:
    """Dependency of the status page and its JSON: as `require_token`, or the page's session
    cookie; loopback clients are no exception."""
    request.state.caller = await gate(request).authorize(request, cookie=True)
