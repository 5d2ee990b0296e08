"""The webhook deliverer: tells a job's `webhook` URL how the job ended.

Where it runs: in the scheduler service, on a thread of its own (a slow receiver never holds
up placement). Every scheduler runs one, but only the leader's takes anything: the take is
fenced on the leader token in Lua (`Store.take_webhooks`), so a standby, or a deposed leader
that has not noticed yet, sends nothing.

What it sends: the scripts that end a job (finish, fail, cancel, overdue, requeue) queue its
id in the same atomic step as the transition (`notify` in prelude.lua), so no ending is lost
to a crash. Each turn the deliverer takes the due ids (each hidden from other takes for
LEASE_S and its try counted before the send), POSTs the event and settles the try:
delivered on a 2xx, else due again after an exponential backoff (BACKOFF_S x 2^(try-1)), and
after MAX_TRIES a final failure, recorded as a `webhook` event of the job (as every try is).

Delivery is at least once, never exactly once: a scheduler that dies after the receiver
answered but before the settle leaves the entry to be taken again when its lease runs out,
and a receiver that answers after our timeout has the event although we count a failure.
Every try of one event carries the same delivery id (the body's `id`, the X-Sdfarm-Delivery
header) for receivers to drop repeats.

The body (JSON): `id`, `type` (job.done, job.failed, job.cancelled), `created`, and `job`:
its id, state, model, submitter, times (created, placed, started, ended), error and the
number of images (fetched with the farm's API; the images themselves would make a webhook
megabytes, and a URL would need the gateway's public address and a token). The prompt only
when the job was submitted with log_prompts; never the owner (a token's fingerprint) or any
token. Signed as sdfarm.scheduler.signing says, with $SDFARM_WEBHOOK_SECRET; a scheduler
without a secret fails every delivery with that reason rather than send unsigned requests.

Addresses: checked again at every try (sdfarm.native.addresses), and the connection goes to
the checked address itself (the name is not resolved twice: DNS rebinding gets nowhere);
TLS still verifies the certificate against the URL's host name. Redirects are not followed
(a 3xx is a failed try): a redirect could point anywhere, private addresses included.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import ssl
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from sdfarm.native.addresses import (
    Network,
    Resolver,
    allowed_addresses,
    default_port,
    resolve_host,
)
from sdfarm.native.errors import InvalidParameterError
from sdfarm.scheduler.signing import DELIVERY_HEADER, EVENT_HEADER, SIGNATURE_HEADER, sign
from sdfarm.store import Store
from sdfarm.store.records import loads

SECRET_ENV = "SDFARM_WEBHOOK_SECRET"
MAX_TRIES = 5
BACKOFF_S = 1.0
"""The wait after the first failed try; doubled after each next one (1, 2, 4, 8 s: a receiver
restarting within about a quarter of a minute still gets the event)."""
TIMEOUT_S = 10.0
"""Connecting, and each read of the answer, may take this long."""
LEASE_S = 60.0
"""How long a taken webhook stays hidden from other takes: longer than a try can take (the
connect and the read timeouts), so only a dead deliverer's entries come back."""
POLL_S = 0.25
BATCH = 16
SENDERS = 4
"""Tries in flight at once: one slow receiver does not hold up the others."""
USER_AGENT = "sdfarm-webhooks/1"
MAX_ERROR_CHARS = 300


def backoff(tries: int, base: float = BACKOFF_S) -> float:
    """Seconds to wait after failed try number `tries` (1-based)."""
    return base * 2 ** max(0, tries - 1)


def delivery_id(job_id: str) -> str:
    """The same on every try of the event: a job ends once, so its id names the event."""
    return f"whd_{job_id}"


def _time(value: str | None) -> float | None:
    try:
        return float(value) if value else None
    except ValueError:
        return None


def payload(job_id: str, record: Mapping[str, str], images: int) -> dict[str, Any]:
    """The event of ended job `job_id` from its record and its image count."""
    spec = loads(record.get("spec"), {})
    state = record.get("state", "")
    job: dict[str, Any] = {
        "id": job_id,
        "state": state,
        "model": record.get("model", ""),
        "submitter": record.get("submitter", ""),
        "created": _time(record.get("created")),
        "placed": _time(record.get("placed")),
        "started": _time(record.get("started")),
        "ended": _time(record.get("ended")),
        "error": record.get("error", ""),
        "images": images,
    }
    if spec.get("log_prompts"):
        params = spec.get("params") or {}
        job["prompt"] = params.get("prompt", "")
        job["negative_prompt"] = params.get("negative_prompt", "")
    return {
        "id": delivery_id(job_id),
        "type": f"job.{state}",
        "created": job["ended"],
        "job": job,
    }


class _PinnedHTTP(http.client.HTTPConnection):
    """An HTTP connection to `address` (already checked) for URL host `host`."""

    def __init__(self, host: str, port: int, address: str, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self.address = address

    def connect(self) -> None:
        self.sock = socket.create_connection((self.address, self.port), self.timeout)


class _PinnedHTTPS(http.client.HTTPSConnection):
    """As _PinnedHTTP, with TLS: SNI and the certificate check use the URL's host name."""

    def __init__(
        self, host: str, port: int, address: str, timeout: float, context: ssl.SSLContext
    ) -> None:
        super().__init__(host, port, timeout=timeout, context=context)
        self.address = address

    def connect(self) -> None:
        sock = socket.create_connection((self.address, self.port), self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host)


def post(
    url: str,
    body: bytes,
    headers: Mapping[str, str],
    *,
    timeout: float = TIMEOUT_S,
    resolve: Resolver = resolve_host,
    allow: bool | tuple[Network, ...] | None = None,
    tls: ssl.SSLContext | None = None,
) -> tuple[int | None, str]:
    """POST `body` to `url` after checking its addresses now (`allow`: the policy's allowance,
    $SDFARM_WEBHOOK_ALLOW_PRIVATE when None; `tls`: the certificates trusted, the system's
    when None): (HTTP status, "") when the receiver answered, (None, why) when the policy
    refused it or nothing answered (a certificate that does not match included)."""
    try:
        found = allowed_addresses("webhook", url, resolve=resolve, allow=allow)
    except InvalidParameterError as exc:
        return None, str(exc)
    parts = urlsplit(url)
    host, port = parts.hostname or "", default_port(parts)
    conn: http.client.HTTPConnection
    if parts.scheme == "https":
        conn = _PinnedHTTPS(host, port, found[0], timeout, tls or ssl.create_default_context())
    else:
        conn = _PinnedHTTP(host, port, found[0], timeout)
    target = parts.path or "/"
    if parts.query:
        target += "?" + parts.query
    try:
        conn.request("POST", target, body=body, headers=dict(headers))
        response = conn.getresponse()
        response.read(65536)
        return response.status, ""
    except (OSError, http.client.HTTPException) as exc:
        return None, f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]
    finally:
        conn.close()


@dataclass
class Outcome:
    """One try: what was settled and why."""

    job_id: str
    tries: int
    outcome: str
    status: int | None = None
    error: str = ""


class Deliverer:
    """Takes, sends and settles due webhooks while this scheduler holds the lease.
    `token` returns the scheduler's leader token; `log(kind, **fields)` its event lines;
    `resolve` and `allow` are the address policy's resolver and allowance, `tls` the
    certificates trusted (tests inject them; by default the system's resolver,
    $SDFARM_WEBHOOK_ALLOW_PRIVATE and the system's CA store)."""

    def __init__(
        self,
        store: Store,
        token: Callable[[], str],
        *,
        secret: str | None = None,
        log: Callable[..., None] = lambda kind, **f: None,
        max_tries: int = MAX_TRIES,
        backoff_s: float = BACKOFF_S,
        timeout_s: float = TIMEOUT_S,
        resolve: Resolver = resolve_host,
        allow: bool | tuple[Network, ...] | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.store = store
        self.token = token
        self.secret = os.environ.get(SECRET_ENV, "") if secret is None else secret
        self.log = log
        self.max_tries = max_tries
        self.backoff_s = backoff_s
        self.timeout_s = timeout_s
        self.resolve = resolve
        self.allow = allow
        self.tls = tls
        self._pool = ThreadPoolExecutor(SENDERS, thread_name_prefix="sdfarm-webhook")

    def turn(self) -> list[Outcome]:
        """Take what is due and try each once; the outcomes, in the order taken."""
        taken = self.store.take_webhooks(self.token(), LEASE_S, BATCH)
        return list(self._pool.map(lambda t: self.deliver(*t), taken))

    def deliver(self, job_id: str, tries: int) -> Outcome:
        """Try once to send job `job_id`'s event (try number `tries`) and settle it."""
        record = self.store.record(job_id)
        url = record.get("webhook", "")
        status: int | None = None
        if not url:
            error = "the job has no webhook"  # queued by an older record: nothing to send
        elif not self.secret:
            error = f"the scheduler has no {SECRET_ENV}; webhooks are never sent unsigned"
        else:
            body = json.dumps(payload(job_id, record, self.store.image_count(job_id))).encode()
            headers = {
                "Content-Type": "application/json",
                "User-Agent": USER_AGENT,
                SIGNATURE_HEADER: sign(self.secret, body),
                DELIVERY_HEADER: delivery_id(job_id),
                EVENT_HEADER: f"job.{record.get('state', '')}",
            }
            status, error = post(
                url,
                body,
                headers,
                timeout=self.timeout_s,
                resolve=self.resolve,
                allow=self.allow,
                tls=self.tls,
            )
            if status is not None and 200 <= status < 300:
                self.store.settle_webhook(job_id, "delivered", tries=tries, status=status)
                self.log("webhook", job=job_id, outcome="delivered", tries=tries)
                return Outcome(job_id, tries, "delivered", status)
            if status is not None:
                error = f"HTTP {status}" + (
                    " (redirects are not followed)" if 300 <= status < 400 else ""
                )
        final = tries >= self.max_tries or not url or not self.secret
        outcome = "failed" if final else "retry"
        delay = 0.0 if final else backoff(tries, self.backoff_s)
        self.store.settle_webhook(
            job_id, outcome, delay, tries=tries, status=status, error=error, retry_in=delay
        )
        self.log("webhook", job=job_id, outcome=outcome, tries=tries, error=error)
        return Outcome(job_id, tries, outcome, status, error)

    def run(self, stopping: threading.Event, on_error: Callable[[Exception], None]) -> None:
        """Turns until `stopping` is set; a Redis error is reported and waited out."""
        import redis

        while not stopping.is_set():
            try:
                if not self.turn():
                    stopping.wait(POLL_S)
            except redis.RedisError as exc:
                on_error(exc)
                stopping.wait(1.0)
        self._pool.shutdown(wait=True)


def start(deliverer: Deliverer, stopping: threading.Event, **kw: Any) -> threading.Thread:
    """The deliverer's thread, started (a daemon: a stuck receiver never blocks an exit
    beyond its timeout)."""
    thread = threading.Thread(
        target=deliverer.run, args=(stopping,), kwargs=kw, name="sdfarm-webhooks", daemon=True
    )
    thread.start()
    return thread
