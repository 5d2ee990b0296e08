"""Webhook signatures (sdfarm.scheduler.signing, sdfarm.client.webhooks for receivers): a
signed body verifies; a changed body, a wrong secret, a stale or future timestamp, a missing
or malformed header are refused; a rotation (two secrets, two signatures) verifies; and the
body the deliverer builds carries no prompt unless the job allowed it, and no owner."""

from __future__ import annotations

import json

import pytest

from sdfarm.client.webhooks import SIGNATURE_HEADER, WebhookSignatureError, sign, verify
from sdfarm.scheduler.signing import signature
from sdfarm.scheduler.webhooks import backoff, delivery_id, payload

SECRET = "whsec-test"
BODY = b'{"id":"whd_1","type":"job.done"}'
NOW = 1_800_000_000


def clock() -> float:
    return NOW + 10


def test_a_signed_body_verifies_with_any_header_case() -> None:
    headers = {SIGNATURE_HEADER.lower(): sign(SECRET, BODY, NOW)}
    assert verify(SECRET, headers, BODY, clock=clock) == NOW
    assert verify(SECRET, list(headers.items()), BODY, clock=clock) == NOW


def test_the_signature_is_hmac_sha256_of_timestamp_dot_body() -> None:
    import hashlib
    import hmac

    want = hmac.new(SECRET.encode(), f"{NOW}.".encode() + BODY, hashlib.sha256).hexdigest()
    assert sign(SECRET, BODY, NOW) == f"t={NOW},v1={want}"


@pytest.mark.parametrize(
    ("headers", "body", "secret", "why"),
    [
        ({SIGNATURE_HEADER: sign(SECRET, BODY, NOW)}, BODY + b" ", SECRET, "no signature"),
        ({SIGNATURE_HEADER: sign(SECRET, BODY, NOW)}, BODY, "other", "no signature"),
        ({SIGNATURE_HEADER: sign(SECRET, BODY, NOW - 400)}, BODY, SECRET, "more than 300"),
        ({SIGNATURE_HEADER: sign(SECRET, BODY, NOW + 400)}, BODY, SECRET, "more than 300"),
        ({}, BODY, SECRET, "no X-Sdfarm-Signature"),
        ({SIGNATURE_HEADER: "v1=abc"}, BODY, SECRET, "malformed"),
        ({SIGNATURE_HEADER: f"t={NOW}"}, BODY, SECRET, "malformed"),
        ({SIGNATURE_HEADER: f"t={NOW},v0=abc"}, BODY, SECRET, "malformed"),
    ],
)
def test_anything_else_is_refused(headers, body, secret, why) -> None:
    with pytest.raises(WebhookSignatureError, match=why):
        verify(secret, headers, body, clock=clock)


def test_a_secret_rotation_verifies_with_either() -> None:
    both = f"t={NOW},v1={signature('old', NOW, BODY)},v1={signature('new', NOW, BODY)}"
    assert verify("old", {SIGNATURE_HEADER: both}, BODY, clock=clock) == NOW
    assert verify(["gone", "new"], {SIGNATURE_HEADER: both}, BODY, clock=clock) == NOW
    with pytest.raises(ValueError):
        sign("", BODY)  # an empty secret signs nothing


RECORD = {
    "state": "done",
    "model": "tiny",
    "submitter": "ann",
    "owner": "token-fingerprint",
    "created": "100.5",
    "started": "101.0",
    "ended": "102.25",
    "error": "",
    "webhook": "https://h.example/",
    "spec": json.dumps({"params": {"prompt": "a secret prompt"}, "log_prompts": False}),
}


def test_the_body_carries_no_prompt_or_owner_unless_allowed() -> None:
    doc = payload("j1", RECORD, 2)
    text = json.dumps(doc)
    assert "a secret prompt" not in text and "token-fingerprint" not in text
    assert doc["id"] == delivery_id("j1") and doc["type"] == "job.done"
    job = doc["job"]
    assert (job["id"], job["state"], job["model"], job["images"]) == ("j1", "done", "tiny", 2)
    assert (job["created"], job["ended"]) == (100.5, 102.25)
    spec = json.dumps({"params": {"prompt": "a shared prompt"}, "log_prompts": True})
    assert payload("j1", {**RECORD, "spec": spec}, 2)["job"]["prompt"] == "a shared prompt"


def test_the_backoff_doubles() -> None:
    assert [backoff(n, 1.0) for n in range(1, 5)] == [1.0, 2.0, 4.0, 8.0]
