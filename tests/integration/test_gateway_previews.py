"""Previews through the gateway over a real local farm: a job with `preview_every` streams
`preview` events whose base64 image arrives intact (never path-scrubbed), the status document
shows the running job's latest preview to its owner only, and the page draws it."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sdfarm.native.preview import MAX_PREVIEW_BYTES, PREVIEW_SIDE, Preview

from helpers.gateway import cpu_farm, served_gateway

MODEL = "tiny-f16"
A, B = "preview-token-a", "preview-token-b"


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture(scope="module")
def gateway(models_dir: Path) -> Iterator[str]:
    with (
        cpu_farm(models_dir, "previewgw") as farm,
        served_gateway(farm.url, [A, B], 60.0, rate_per_minute=100_000) as url,
    ):
        yield url


def sse_events(url: str, job_id: str, out: list[dict[str, Any]]) -> None:
    """Collects the job's server-sent events until the stream ends."""
    with httpx.stream("GET", f"{url}/v1/jobs/{job_id}/events", headers=bearer(A), timeout=120) as s:
        kind = ""
        for line in s.iter_lines():
            if line.startswith("event: "):
                kind = line[len("event: ") :]
            elif line.startswith("data: "):
                out.append({"kind": kind, **json.loads(line[len("data: ") :])})


def test_previews_stream_and_show_on_the_status_page_of_their_owner(gateway: str) -> None:
    job = {"model": MODEL, "prompt": "a preview through the gateway", "width": 128,
           "height": 128, "steps": 8, "seed": 3, "preview_every": 1}  # fmt: skip
    warm = httpx.post(f"{gateway}/v1/jobs", json={**job, "preview_every": 0, "steps": 1},
                      headers=bearer(A))  # fmt: skip
    assert warm.status_code == 202, warm.text
    created = httpx.post(f"{gateway}/v1/jobs", json=job, headers=bearer(A))
    assert created.status_code == 202, created.text
    job_id = created.json()["id"]
    events: list[dict[str, Any]] = []
    reader = threading.Thread(target=sse_events, args=(gateway, job_id, events), daemon=True)
    reader.start()
    shown: list[dict[str, Any]] = []
    others: list[dict[str, Any]] = []
    deadline = time.monotonic() + 120
    with httpx.Client(base_url=gateway, timeout=30) as c:
        while c.get(f"/v1/jobs/{job_id}", headers=bearer(A)).json()["state"] != "done":
            assert time.monotonic() < deadline, "the job did not end"
            status = c.get("/v1/status", headers=bearer(A))
            assert status.status_code == 200, status.text
            mine = status.json()["running"]
            shown += [r["preview"] for r in mine if r["id"] == job_id and r.get("preview")]
            others += c.get("/v1/status", headers=bearer(B)).json()["running"]
            time.sleep(0.05)
        page = c.get("/", headers=bearer(A)).text
    reader.join(60)
    assert not reader.is_alive()

    previews = [Preview.from_event(e) for e in events if e["kind"] == "preview"]
    assert previews, [e["kind"] for e in events]
    assert events[-1]["kind"] == "done"
    steps = [p.step for p in previews]
    assert steps == sorted(set(steps)) and all(1 <= s <= 8 for s in steps)
    for p in previews:  # the base64 came through unscrubbed: it decodes to the image
        assert len(p.data) <= MAX_PREVIEW_BYTES and max(p.image.size) <= PREVIEW_SIDE

    assert shown, "the status document never showed the running job's preview"
    for v in shown:
        assert v["url"].startswith("data:image/webp;base64,") and 1 <= v["step"] <= 8
        assert Preview.from_event({**v, "image": v["url"].split(",", 1)[1]}).image.size == (
            v["width"],
            v["height"],
        )
    assert all(r["id"] != job_id for r in others)  # another token never sees it
    assert 'class="preview"' in page and "v.url" in page
