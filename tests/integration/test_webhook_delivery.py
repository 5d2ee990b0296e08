"""The deliverer (sdfarm.scheduler.webhooks) against a real redis-server and real HTTP
receivers on 127.0.0.1, with the address policy's resolver and allowance injected: the
connection goes to the address that was checked (the name is never looked up again), a name
that now resolves to a private address is refused at delivery (DNS rebinding), a redirect is
not followed, TLS checks the certificate against the URL's host although the connection
goes to an address, the tries end in a recorded failure, and without a secret nothing is
sent."""

from __future__ import annotations

import ipaddress
import json
import shutil
import ssl
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from sdfarm.client.webhooks import verify
from sdfarm.scheduler.webhooks import Deliverer
from sdfarm.store import JobSpec, Store

from helpers.leader import TOKEN

SECRET = "whsec-delivery"
LOOPBACK = (ipaddress.ip_network("127.0.0.1/32"),)


class Receiver:
    """Records each request's headers and body; answers `status` (with `location` if set)."""

    def __init__(
        self, status: int = 200, location: str = "", tls: ssl.SSLContext | None = None
    ) -> None:
        self.got: list[tuple[dict[str, str], bytes]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                receiver.got.append((dict(self.headers.items()), body))
                self.send_response(status)
                if location:
                    self.send_header("Location", location)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if tls is not None:
            self.server.socket = tls.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def ended_job(store: Store, webhook: str) -> str:
    """A job with `webhook` (stored as a submit that passed the policy would store it), ended."""
    job_id, _, _ = store.submit(JobSpec(model="m", params={"prompt": "p"}, webhook=webhook), 10)
    assert job_id is not None and store.cancel(job_id) == 1
    return job_id


def deliverer(store: Store, resolve: Any, **kw: Any) -> Deliverer:
    kw.setdefault("secret", SECRET)
    return Deliverer(store, lambda: TOKEN, resolve=resolve, allow=LOOPBACK, **kw)


def last_event(store: Store, job_id: str) -> dict[str, Any]:
    return [e for e in store.events(job_id) if e["event"] == "webhook"][-1]


def test_the_connection_goes_to_the_checked_address_under_the_url_host(store: Store) -> None:
    r = Receiver()
    try:
        job_id = ended_job(store, f"http://hooks.test:{r.port}/in")  # no DNS knows this name
        [out] = deliverer(store, lambda host, port: ["127.0.0.1"]).turn()
        assert out.outcome == "delivered", out
        [(headers, body)] = r.got
        assert headers["Host"] == f"hooks.test:{r.port}"
        verify(SECRET, headers, body)
        event = json.loads(body)
        assert (event["type"], event["job"]["id"]) == ("job.cancelled", job_id)
    finally:
        r.close()


def test_a_name_that_now_resolves_to_a_private_address_is_refused(store: Store) -> None:
    r = Receiver()
    try:
        job_id = ended_job(store, f"http://hooks.test:{r.port}/in")
        [out] = deliverer(store, lambda host, port: ["10.0.0.7"]).turn()
        assert out.outcome == "retry" and "10.0.0.7" in out.error and r.got == []
        assert "private" in last_event(store, job_id)["error"]
    finally:
        r.close()


def test_a_redirect_is_not_followed(store: Store) -> None:
    target = Receiver()
    r = Receiver(302, location=f"http://127.0.0.1:{target.port}/elsewhere")
    try:
        job_id = ended_job(store, f"http://127.0.0.1:{r.port}/in")
        [out] = deliverer(store, lambda host, port: [host]).turn()
        assert (out.outcome, out.status) == ("retry", 302) and "not followed" in out.error
        assert len(r.got) == 1 and target.got == []
        assert last_event(store, job_id)["status"] == 302
    finally:
        r.close()
        target.close()


def test_the_last_try_fails_and_is_recorded(store: Store) -> None:
    r = Receiver(503)
    try:
        job_id = ended_job(store, f"http://127.0.0.1:{r.port}/in")
        d = deliverer(store, lambda host, port: [host], max_tries=2, backoff_s=0.0)
        assert [o.outcome for o in d.turn()] == ["retry"]
        assert [o.outcome for o in d.turn()] == ["failed"]
        assert d.turn() == [] and len(r.got) == 2
        assert store.record(job_id)["webhook_state"] == "failed"
        assert (last_event(store, job_id)["tries"], last_event(store, job_id)["error"]) == (
            2,
            "HTTP 503",
        )
    finally:
        r.close()


def test_without_a_secret_nothing_is_sent(store: Store) -> None:
    r = Receiver()
    try:
        job_id = ended_job(store, f"http://127.0.0.1:{r.port}/in")
        [out] = deliverer(store, lambda host, port: [host], secret="").turn()
        assert out.outcome == "failed" and "SDFARM_WEBHOOK_SECRET" in out.error and r.got == []
        assert store.webhooks_queued() == {} and store.record(job_id)["webhook_state"] == "failed"
    finally:
        r.close()


def test_a_standby_delivers_nothing(store: Store) -> None:
    r = Receiver()
    try:
        ended_job(store, f"http://127.0.0.1:{r.port}/in")
        standby = Deliverer(store, lambda: "standby", secret=SECRET, allow=LOOPBACK)
        assert standby.turn() == [] and r.got == []
        assert len(deliverer(store, lambda host, port: [host]).turn()) == 1 and len(r.got) == 1
    finally:
        r.close()


def self_signed(folder: Path, name: str) -> tuple[Path, Path]:
    """A certificate for DNS name `name` and its key, made by the openssl command."""
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", f"/CN={name}", "-addext", f"subjectAltName=DNS:{name}",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_tls_checks_the_certificate_against_the_url_host(store: Store, tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path, "hooks.test")
    server_tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_tls.load_cert_chain(cert, key)
    trust = ssl.create_default_context(cafile=str(cert))
    r = Receiver(tls=server_tls)
    try:
        to_loopback = lambda host, port: ["127.0.0.1"]  # noqa: E731
        good = ended_job(store, f"https://hooks.test:{r.port}/in")
        [out] = deliverer(store, to_loopback, tls=trust).turn()
        assert (out.job_id, out.outcome) == (good, "delivered") and len(r.got) == 1
        ended_job(store, f"https://other.test:{r.port}/in")  # the certificate is not for it
        [out] = deliverer(store, to_loopback, tls=trust).turn()
        assert out.outcome == "retry" and "certificate" in out.error.lower(), out
        assert len(r.got) == 1
    finally:
        r.close()
