"""For receivers of the farm's webhooks: check that a request came from the farm.

    from sdfarm.client.webhooks import WebhookSignatureError, verify

    body = request.body()          # the raw bytes, before any JSON parsing
    try:
        verify(os.environ["SDFARM_WEBHOOK_SECRET"], request.headers, body)
    except WebhookSignatureError:
        return 400
    event = json.loads(body)       # {"id": delivery id, "type": "job.done", "job": {...}}

Delivery is at least once: the farm sends again after a failed try, and after a scheduler
crash between the send and its record, so the same event can arrive twice. Its `id` (also
the `X-Sdfarm-Delivery` header) is the same on every try: keep the ids seen and skip repeats.
The signature scheme is in sdfarm.scheduler.signing.
"""

from __future__ import annotations

from sdfarm.scheduler.signing import (
    DELIVERY_HEADER,
    EVENT_HEADER,
    SIGNATURE_HEADER,
    WebhookSignatureError,
    sign,
    verify,
)

__all__ = [
    "DELIVERY_HEADER",
    "EVENT_HEADER",
    "SIGNATURE_HEADER",
    "WebhookSignatureError",
    "sign",
    "verify",
]
