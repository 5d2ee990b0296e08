"""The status page (`GET /`) and its JSON (`GET /v1/status`) over a real local farm, and a
screenshot of the page in headless Chromium while a batch of tiny jobs runs, written to
docs/status-page.png."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from helpers.gateway import cpu_farm, served_gateway

MODEL = "tiny-q8_0"
TOKEN = "gateway-page-token"
CHROMIUM = "/usr/bin/chromium"
SHOT = Path(__file__).resolve().parents[2] / "docs" / "status-page.png"
WIDTH, HEIGHT = 1280, 900
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def local_farm(models_dir: Path) -> Iterator[Any]:
    with cpu_farm(models_dir, "pagehost") as farm:
        yield farm


@pytest.fixture(scope="module")
def gateway(local_farm: Any) -> Iterator[str]:
    with served_gateway(local_farm.url, [TOKEN], 60.0, rate_per_minute=6000) as url:
        yield url


def _submit(gateway: str, n: int, *, steps: int = 1, tag: str = "") -> list[str]:
    ids = []
    with httpx.Client(base_url=gateway, headers={"Authorization": f"Bearer {TOKEN}"}) as c:
        for k in range(n):
            r = c.post(
                "/v1/jobs",
                json={"model": MODEL, "prompt": f"{tag} image {k}", "width": 64, "height": 64,
                      "steps": steps, "seed": 1000 + k, "priority": k % 3 * 3},
            )  # fmt: skip
            assert r.status_code == 202, r.text
            ids.append(r.json()["id"])
    return ids


def _wait_done(gateway: str, ids: list[str], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=gateway, headers={"Authorization": f"Bearer {TOKEN}"}) as c:
        for job_id in ids:
            while c.get(f"/v1/jobs/{job_id}").json()["state"] != "done":
                assert time.monotonic() < deadline, f"job {job_id} not done"
                time.sleep(0.1)


def test_page_needs_the_token_even_on_loopback(gateway: str) -> None:
    assert httpx.get(f"{gateway}/").status_code == 401  # tokens on: loopback is no exception
    assert httpx.get(f"{gateway}/v1/status").status_code == 401
    form = httpx.get(f"{gateway}/", headers={"Accept": "text/html"})
    assert form.status_code == 401 and 'name="token"' in form.text  # a browser's sign-in
    r = httpx.get(f"{gateway}/", headers=AUTH)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert '<div id="sdfarm-status">' in r.text and "v1/status" in r.text


def test_a_browser_signs_in_with_a_session_cookie(gateway: str) -> None:
    with httpx.Client(base_url=gateway, follow_redirects=True) as browser:
        bad = browser.get("/?token=wrong")
        assert bad.status_code == 401 and not browser.cookies
        r = browser.get(f"/?token={TOKEN}")  # follows the redirect to "/" with the cookie
        assert r.status_code == 200 and '<div id="sdfarm-status">' in r.text
        assert str(r.url) == f"{gateway}/" and TOKEN not in str(browser.cookies)
        assert browser.get("/v1/status").json()["devices"]
        assert browser.get("/v1/models").status_code == 401  # the cookie is for the page only


def test_status_json_has_devices_with_memory(gateway: str) -> None:
    ids = _submit(gateway, 2, tag="status")
    _wait_done(gateway, ids)
    # The worker's heartbeat lists the loaded engine on its next beat (once a second): read
    # the status until it does, for at most a few beats.
    deadline = time.monotonic() + 5
    while True:
        doc = httpx.get(f"{gateway}/v1/status", headers=AUTH).json()
        loaded = [m["name"] for d in doc["devices"] for m in d.get("loaded") or []]
        if loaded or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert doc["hosts"] == [{"host": "pagehost", "devices": ["pagehost/CPU"]}]
    (dev,) = doc["devices"]
    assert dev["alive"] and dev["key"] == "pagehost/CPU"
    mem = dev["memory"]
    assert set(mem) == {"total", "free", "ours", "other"}
    assert mem["total"] > 0 and 0 <= mem["free"] <= mem["total"] and mem["other"] >= 0
    assert [m["name"] for m in dev["loaded"]] == [MODEL]
    assert mem["ours"] == sum(m["estimate"] for m in dev["loaded"]) > 0
    assert doc["queues"] and all(n >= 0 for n in doc["queues"].values())
    recent = {x["id"]: x for x in doc["recent"]}
    assert set(ids) <= set(recent)
    img = httpx.get(f"{gateway}/{recent[ids[0]]['url']}")  # signed: no token needed
    assert img.status_code == 200 and img.content.startswith(b"\x89PNG")


def test_status_off_loopback_needs_the_token(local_farm: Any) -> None:
    from fastapi.testclient import TestClient

    from sdfarm.gateway import create_app

    app = create_app(local_farm.url, tokens=[TOKEN])
    try:
        with TestClient(app, base_url="http://localhost") as c:
            assert c.get("/").status_code == 401
            assert c.get("/v1/status").status_code == 401
            auth = {"Authorization": f"Bearer {TOKEN}"}
            assert c.get("/", headers=auth).status_code == 200
            assert c.get("/v1/status", headers=auth).json()["devices"]
    finally:
        app.state.farm.close()


@pytest.mark.skipif(
    not Path(CHROMIUM).exists(), reason=f"{CHROMIUM} is absent (.ci/run installs it)"
)
def test_screenshot_while_a_batch_runs(gateway: str, tmp_path: Path) -> None:
    from PIL import Image

    _wait_done(gateway, _submit(gateway, 8, tag="warm-up"))
    batch = _submit(gateway, 20, tag="batch")
    deadline = time.monotonic() + 30
    while not httpx.get(f"{gateway}/v1/status", headers=AUTH).json()["running"]:
        assert time.monotonic() < deadline, "no job of the batch started"
        time.sleep(0.02)
    tmp_shot = tmp_path / "shot.png"
    for attempt in (1, 2):  # headless chromium has hung once on a slow CI machine: one more try
        cmd = [
            CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
            "--no-first-run", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--hide-scrollbars",
            f"--user-data-dir={tmp_path / f'profile{attempt}'}",
            f"--window-size={WIDTH},{HEIGHT}", "--virtual-time-budget=1500",
            f"--screenshot={tmp_shot}", f"{gateway}/?token={TOKEN}",
        ]  # fmt: skip
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=90, check=False)
            break
        except subprocess.TimeoutExpired:
            if attempt == 2:
                raise
    assert proc.returncode == 0 and tmp_shot.exists(), proc.stderr[-2000:]
    SHOT.parent.mkdir(exist_ok=True)
    shutil.copyfile(tmp_shot, SHOT)
    with Image.open(SHOT) as im:
        assert im.width >= WIDTH
        colours = im.convert("RGB").getcolors(maxcolors=1 << 20) or []
    assert len(colours) > 16, f"the screenshot looks blank ({len(colours)} colours)"
    _wait_done(gateway, batch)
