"""The gateway's security rules without a farm: the client's address behind trusted proxies and
the rate limit keyed on it, failed authentications counted, the Host check, the status page's
session, the error statuses of a job's end, paths scrubbed from errors, invalid UTF-8 refused,
and the CLI's flags. A fake farm stands in where a route would reach Redis."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from sdfarm.client.farm import JobFailed
from sdfarm.gateway import create_app
from sdfarm.gateway.auth import Gate, fingerprint
from sdfarm.gateway.cli import build_parser, collect_tokens
from sdfarm.gateway.errors import PATH_MARK, APIError, _farm_error, scrub_paths
from sdfarm.gateway.hosts import AllowedHosts, allowed_hosts
from sdfarm.gateway.ratelimit import MEMORY
from sdfarm.native.catalog import Catalog
from sdfarm.native.errors import ModelLoadError

NOWHERE = "redis://127.0.0.1:1/0"
LOCAL = "http://localhost"
JOB = {"model": "m", "prompt": "x"}


class FakeStore:
    """What the routes under test read of a farm's store."""

    def __init__(self) -> None:
        self.records: dict[str, dict[str, str]] = {}
        self.event_lists: dict[str, list[dict[str, Any]]] = {}

    def state(self, job_id: str) -> str:
        return self.records.get(job_id, {}).get("state", "")

    def events(self, job_id: str) -> list[dict[str, Any]]:
        return self.event_lists.get(job_id, [])

    def jobs_fields(self, ids: list[str], names: list[str]) -> list[list[str]]:
        return [[self.records.get(i, {}).get(n, "") for n in names] for i in ids]

    def close(self) -> None:
        pass


class FakeJob:
    def __init__(self, job_id: str, error: BaseException | None) -> None:
        self.id = job_id
        self.error = error

    def result(self, timeout: float | None = None) -> Any:
        if self.error is not None:
            raise self.error
        return type("R", (), {"pngs": [b"\x89PNG"]})()

    async def result_async(self, store: Any, timeout: float | None = None) -> Any:
        """What the async handlers await: the same end as `result`."""
        return self.result(timeout)


class FakeFarm:
    """Submits record the owner; every job ends with `error` (None: one image)."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.store = FakeStore()
        self.error = error
        self.owners: list[str] = []

    def submit(self, model: str, prompt: str, *, owner: str = "", **fields: Any) -> FakeJob:
        self.owners.append(owner)
        return FakeJob("a" * 32, self.error)

    def models(self) -> list[dict[str, Any]]:
        return []

    def close(self) -> None:
        pass


@pytest.fixture
def fake() -> FakeFarm:
    return FakeFarm()


def client(farm: Any, *, peer: str = "10.0.0.7", **options: Any) -> TestClient:
    """The app over `farm`, its rate counted in this process (the shared Redis counts:
    tests/integration/test_gateway_shared_limits.py)."""
    app = create_app(NOWHERE, farm=farm, rate_storage=MEMORY, **options)
    return TestClient(app, base_url=LOCAL, client=(peer, 1))


# -- rate limits: the real address, failed authentications, bounded memory ------------------


def test_rotating_x_forwarded_for_does_not_bypass_the_limit(fake: FakeFarm) -> None:
    with client(fake, rate_per_minute=6) as c:  # a burst of 1
        assert c.get("/v1/models", headers={"X-Forwarded-For": "1.1.1.1"}).status_code == 200
        for k in range(50):
            r = c.get("/v1/models", headers={"X-Forwarded-For": f"2.2.2.{k}"})
            assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1


def test_a_trusted_proxys_x_forwarded_for_names_the_client(fake: FakeFarm) -> None:
    with client(fake, peer="10.0.0.2", rate_per_minute=6, trusted_proxies=["10.0.0.0/24"]) as c:
        for k in range(3):  # a client each, behind the proxy: each its own burst
            xff = {"X-Forwarded-For": f"203.0.113.{k}"}
            assert c.get("/v1/models", headers=xff).status_code == 200
            assert c.get("/v1/models", headers=xff).status_code == 429


def test_client_address_reads_x_forwarded_for_from_the_right() -> None:
    gate = Gate([], 60, trusted_proxies=["10.0.0.0/8", "::1/128"])

    def addr(peer: str, *xff: str) -> str:
        headers = [(b"x-forwarded-for", v.encode()) for v in xff]
        scope = {"type": "http", "client": (peer, 1), "headers": headers}
        from starlette.requests import Request

        return gate.client_address(Request(scope))

    assert addr("192.0.2.9", "1.2.3.4") == "192.0.2.9"  # not a trusted peer: XFF ignored
    assert addr("10.1.1.1", "1.2.3.4") == "1.2.3.4"
    assert addr("10.1.1.1", "6.6.6.6, 1.2.3.4, 10.2.2.2") == "1.2.3.4"  # the spoofed one: left
    assert addr("10.1.1.1", "6.6.6.6", "1.2.3.4") == "1.2.3.4"  # several headers
    assert addr("::1", "[2001:db8::5]:443") == "2001:db8::5"
    assert addr("10.1.1.1", "garbage, 10.3.3.3") == "10.3.3.3"  # stops at what it cannot read
    assert addr("10.1.1.1") == "10.1.1.1"


def test_failed_authentication_counts_against_the_peer(fake: FakeFarm) -> None:
    with client(fake, tokens=["good"], rate_per_minute=60) as c:  # bursts of 10
        codes = [c.get("/v1/models", headers={"Authorization": f"Bearer guess{k}"}).status_code
                 for k in range(12)]  # fmt: skip
        assert codes[:10] == [401] * 10 and codes[10:] == [429, 429]
        assert c.get("/v1/models").status_code == 429  # no token at all: counted as well
        ok = c.get("/v1/models", headers={"Authorization": "Bearer good"})
        assert ok.status_code == 200  # the token has its own count


# -- owners ------------------------------------------------------------------------------------


def test_jobs_record_the_tokens_fingerprint_never_the_token(fake: FakeFarm) -> None:
    with client(fake, tokens=["tok-a"], operator_tokens=["op"]) as c:
        for token in ("tok-a", "op"):
            r = c.post("/v1/jobs", json=JOB, headers={"Authorization": f"Bearer {token}"})
            assert r.status_code == 202
    assert fake.owners == [fingerprint("tok-a"), fingerprint("op")]
    assert fingerprint("tok-a") == __import__("hashlib").sha256(b"tok-a").hexdigest()[:16]
    with client(fake) as c:  # an open gateway: no owner
        assert c.post("/v1/jobs", json=JOB).status_code == 202
    assert fake.owners[-1] == ""


def test_session_cookies_stand_for_a_token_until_they_expire() -> None:
    gate = Gate(["tok-a"], 60, operator_tokens=["op"])
    a = gate.session_caller(gate.session_cookie(gate._token_caller("tok-a"), now=1000), now=1000)
    assert a is not None and a.owner == fingerprint("tok-a") and not a.sees_all
    op = gate.session_cookie(gate._token_caller("op"), now=1000)
    assert "op" not in op.split(".")[0] and gate.session_caller(op, now=2000).sees_all
    assert gate.session_caller(op, now=1000 + 13 * 3600) is None  # expired
    owner, expires, sig = op.split(".")
    assert gate.session_caller(f"{owner}.{int(expires) + 9999}.{sig}", now=1000) is None
    other = Gate(["tok-b"], 60)
    assert other.session_caller(op, now=1000) is None


# -- the Host header -----------------------------------------------------------------------------


def test_unknown_hosts_get_400_in_openai_shape(fake: FakeFarm) -> None:
    with client(fake) as c:
        for host in ("evil.example", "localhost.evil.example", "127.0.0.2:8000"):
            r = c.get("/healthz", headers={"Host": host})
            assert r.status_code == 400, host
            assert r.json()["error"]["code"] == "invalid_host"
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        for host in ("localhost", "localhost:8000", "127.0.0.1:9", "[::1]:8000", "LOCALHOST."):
            assert c.get("/v1/models", headers={"Host": host}).status_code == 200, host


def test_allowed_host_rules() -> None:
    hosts = AllowedHosts(allowed_hosts("10.0.0.1", ["farm.example.com", "*.corp.example"]))
    assert hosts.allows("10.0.0.1:8000") and hosts.allows("localhost")
    assert hosts.allows("FARM.example.com:443") and not hosts.allows("example.com")
    assert hosts.allows("corp.example") and hosts.allows("a.b.corp.example")
    assert not hosts.allows("evilcorp.example") and not hosts.allows(None)
    assert AllowedHosts(["*"]).allows("anything") and AllowedHosts(["*"]).allows(None)
    with client(FakeFarm(), allowed_hosts=["*"]) as c:
        assert c.get("/v1/models", headers={"Host": "evil.example"}).status_code == 200


# -- what a job's end answers ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("state", "events", "error", "want"),
    [
        ("failed", [{"event": "failed", "reason": "deadline"}], JobFailed("j", "deadline: x"),
         (504, "deadline_exceeded")),
        ("running", [], JobFailed("j", "still running past its deadline"),
         (504, "deadline_exceeded")),
        ("failed", [{"event": "failed"}], JobFailed("j", "runtime error", estimate=4096),
         (500, "job_failed")),
        ("failed", [{"event": "failed", "reason": "poison"}], JobFailed("j", "lost twice"),
         (500, "job_failed")),
        ("failed", [], JobFailed("j", "too large", figures=[{"device": "CPU"}], estimate=9),
         (507, "insufficient_memory")),
    ],
)  # fmt: skip
def test_job_failures_get_the_status_of_what_failed(
    state: str, events: list[dict[str, Any]], error: JobFailed, want: tuple[int, str]
) -> None:
    farm = FakeFarm(error)
    error.job_id = "a" * 32
    farm.store.records["a" * 32] = {"state": state}
    farm.store.event_lists["a" * 32] = events
    with client(farm) as c:
        r = c.post("/v1/images/generations", json={**JOB, "response_format": "b64_json"})
    assert (r.status_code, r.json()["error"]["code"]) == want


def test_a_placed_jobs_estimate_alone_is_no_memory_refusal() -> None:
    assert _farm_error(JobFailed("j", "generation failed", estimate=123456)).status == 500
    assert _farm_error(JobFailed("j", "x", figures=[{"device": "CPU"}], estimate=1)).status == 507


def test_redis_unavailable_is_503_in_openai_shape() -> None:
    with TestClient(create_app(NOWHERE, tokens=["t"]), base_url=LOCAL) as c:
        auth = {"Authorization": "Bearer t"}
        for method, path in [("GET", "/v1/jobs/" + "a" * 32), ("DELETE", "/v1/jobs/" + "a" * 32),
                             ("GET", "/v1/jobs/" + "a" * 32 + "/events"),
                             ("GET", f"/v1/jobs/{'a' * 32}/image.png")]:  # fmt: skip
            r = c.request(method, path, headers=auth)
            assert r.status_code == 503, (path, r.text)
            assert r.json()["error"]["code"] == "farm_error"
        assert c.get("/healthz").status_code == 503


# -- no filesystem paths in errors ------------------------------------------------------------


def test_scrub_paths() -> None:
    assert scrub_paths("unknown model 'x'; models: a, b (in /srv/models, /opt/m)") == (
        f"unknown model 'x'; models: a, b (in {PATH_MARK}, {PATH_MARK})"
    )
    assert scrub_paths("cannot read '/a/b c.gguf': no") == f"cannot read '{PATH_MARK} c.gguf': no"
    assert scrub_paths("dirs /a/m:/b/m") == f"dirs {PATH_MARK}:{PATH_MARK}"
    assert scrub_paths(r"in C:\models\x") == f"in {PATH_MARK}"
    kept = "see http://host:8000/v1/jobs and 64/128 steps, ratio 1/2, s/step, a/b"
    assert scrub_paths(kept) == kept


def test_a_real_unknown_model_error_leaves_without_its_folder(tmp_path: Path) -> None:
    models = tmp_path / "secret-models"
    models.mkdir()
    with pytest.raises(ModelLoadError) as info:
        Catalog([models]).path("no-such-model")
    assert str(models) in str(info.value)  # the catalog's own error names the folder
    for exc in (JobFailed("j", str(info.value)), info.value, RuntimeError(str(info.value))):
        body = _farm_error(exc).response().body.decode()
        assert str(tmp_path) not in body and "secret-models" not in body, body
        assert "no-such-model" in body and PATH_MARK in body
    farm = FakeFarm(JobFailed("a" * 32, str(info.value), estimate=100))
    farm.store.records["a" * 32] = {"state": "failed"}
    with client(farm) as c:
        r = c.post("/v1/images/generations", json=JOB)
    assert r.status_code == 500 and r.json()["error"]["code"] == "job_failed"
    assert str(tmp_path) not in r.text and "no-such-model" in r.text


# -- invalid UTF-8 -------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/jobs", "/v1/images/generations"])
def test_invalid_utf8_is_a_400_that_says_so(fake: FakeFarm, path: str) -> None:
    headers = {"content-type": "application/json"}
    with client(fake) as c:
        r = c.post(path, content=b'{"model": "m", "prompt": "caf\xe9"}', headers=headers)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "invalid_encoding" and "UTF-8" in err["message"]
        assert "0xe9" in err["message"]
        for body, param in [('{"model": "m", "prompt": "a\\ud800b"}', "prompt"),
                            ('{"model": "m\\udfff", "prompt": "x"}', "model"),
                            ('{"model": "m", "prompt": "x", "user": ["\\ud83d"]}', "user"),
                            ('{"model": "m", "prompt": "x", "\\ud800": 1}', "body")]:  # fmt: skip
            r = c.post(path, content=body.encode(), headers=headers)
            assert r.status_code == 400, (body, r.text)
            err = r.json()["error"]
            assert (err["code"], err["param"]) == ("invalid_encoding", param), body
        ok = json.dumps({"model": "m", "prompt": "caf\u00e9 \U0001f600 \\ud83d\\ude00"})
        assert c.post(path, content=ok.encode(), headers=headers).status_code in (200, 202)
    assert fake.owners  # the valid one went through


# -- the CLI ----------------------------------------------------------------------------------


def test_cli_flags() -> None:
    args = build_parser().parse_args(
        ["--operator-token", "op1", "--operator-token", "op2", "--trusted-proxy", "10.0.0.0/8",
         "--trusted-proxy", "::1", "--allowed-host", "farm.example.com", "--allowed-host", "*"]
    )  # fmt: skip
    assert args.operator_token == ["op1", "op2"]
    assert args.trusted_proxy == ["10.0.0.0/8", "::1"]
    assert args.allowed_host == ["farm.example.com", "*"]
    assert collect_tokens(args.operator_token, "op3,op1") == ["op1", "op2", "op3"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--trusted-proxy", "not-a-cidr"])
    plain = build_parser().parse_args([])
    assert (plain.operator_token, plain.trusted_proxy, plain.allowed_host) == ([], [], [])


def test_api_error_messages_are_scrubbed_in_one_place() -> None:
    r = APIError(400, "bad file /etc/sdfarm/models/x.gguf").response()
    assert b"/etc/sdfarm" not in r.body and PATH_MARK.encode() in r.body


def test_the_access_log_never_shows_a_sign_in_token() -> None:
    import logging

    from sdfarm.gateway.cli import _RedactTokens

    record = logging.LogRecord(
        "uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
        ("127.0.0.1:5", "GET", "/?a=1&token=s3cret&b=2", "1.1", 303), None,
    )  # fmt: skip
    assert _RedactTokens().filter(record)
    assert "s3cret" not in record.getMessage() and "token=***&b=2" in record.getMessage()
