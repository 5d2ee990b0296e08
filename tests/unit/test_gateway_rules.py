"""The gateway's pure rules: size parsing, the request models derived from the job schema,
error mapping (OpenAI's shape and status codes), token and bind rules, the body limit. No farm:
the app points at a Redis that is not there (parameters are checked before Redis is asked)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from sdfarm.client.farm import FarmBusyError, JobCancelled, JobFailed, UnknownModelError
from sdfarm.gateway import create_app
from sdfarm.gateway.bodylimit import MAX_BODY
from sdfarm.gateway.cli import check_bind, collect_tokens, is_loopback
from sdfarm.gateway.errors import APIError, _farm_error
from sdfarm.gateway.schemas import ImagesRequest, JobRequest, parse_size
from sdfarm.native.errors import InvalidParameterError
from sdfarm.native.params import BY_NAME, MAX_BATCH, MAX_SIZE, NAMES

NOWHERE = "redis://127.0.0.1:1/0"
LOCAL = "http://localhost"  # a Host the gateway serves (TestClient says "testserver")


@pytest.mark.parametrize(
    ("size", "want"),
    [("64x64", (64, 64)), ("2048x8", None), ("512X768", (512, 768)), ("4096x64", (4096, 64))],
)
def test_parse_size(size: str, want: tuple[int, int] | None) -> None:
    if want is None:
        with pytest.raises(APIError) as info:
            parse_size(size)
        assert info.value.status == 400 and info.value.param == "size"
    else:
        assert parse_size(size) == want


@pytest.mark.parametrize("size", ["", "64", "64x", "x64", "65x64", "64x4104", "4104x64", "axb"])
def test_bad_sizes_name_the_param(size: str) -> None:
    with pytest.raises(APIError) as info:
        parse_size(size)
    assert (info.value.status, info.value.param) == (400, "size")


def test_a_bad_side_gets_the_schemas_own_error_text() -> None:
    with pytest.raises(InvalidParameterError) as want:
        BY_NAME["width"].check(4104)
    with pytest.raises(APIError) as got:
        parse_size("4104x64")
    assert got.value.message == str(want.value)


def test_request_models_are_the_job_schema() -> None:
    assert list(JobRequest.model_fields) == ["model", *NAMES, "priority", "submitter", "webhook"]
    carried = {"width", "height", "batch_count"}
    openai_fields = {"model", "n", "size", "response_format", "user", "priority", "webhook"}
    assert set(ImagesRequest.model_fields) == openai_fields | (set(NAMES) - carried)
    for name in NAMES:
        p, field = BY_NAME[name], JobRequest.model_fields[name]
        assert field.is_required() == p.required and p.help in (field.description or "")
    props = JobRequest.model_json_schema()["properties"]
    assert (props["width"]["minimum"], props["width"]["maximum"]) == (64, MAX_SIZE)
    assert props["width"]["multipleOf"] == 8 and props["seed"]["minimum"] == -1
    assert "euler" in props["sampler"]["enum"]
    assert ImagesRequest.model_json_schema()["properties"]["n"]["maximum"] == MAX_BATCH


def test_error_mapping() -> None:
    e = _farm_error(InvalidParameterError("width", "65 is not a multiple of 8"), size_param=True)
    assert (e.status, e.param) == (400, "size")
    e = _farm_error(UnknownModelError("x", ["a"]))
    assert (e.status, e.param, e.code) == (404, "model", "model_not_found")
    e = _farm_error(FarmBusyError(10, 10))
    assert e.status == 429 and e.headers["Retry-After"].isdigit()
    e = _farm_error(
        JobFailed("j", "model too large", figures=[{"device": "Vulkan0", "figure": 1024}],
                  estimate=4096)
    )  # fmt: skip
    assert e.status == 507 and "4096" in e.message and "Vulkan0" in e.message
    assert _farm_error(JobFailed("j", "runtime error")).status == 500
    assert _farm_error(JobCancelled("j")).status == 409
    assert _farm_error(TimeoutError("slow")).status == 504
    doc = json.loads(bytes(APIError(400, "m", param="p", code="c").response().body))
    assert doc == {"error": {"message": "m", "type": "invalid_request_error", "param": "p",
                             "code": "c"}}  # fmt: skip


def test_tokens_and_bind_rules() -> None:
    assert collect_tokens(["a", "b"], "c, d a") == ["a", "b", "c", "d"]
    assert collect_tokens([], None) == []
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")
    assert check_bind("127.0.0.1", []) is None
    assert check_bind("0.0.0.0", ["t"]) is None
    assert "without a token" in (check_bind("0.0.0.0", []) or "")


@pytest.fixture
def open_app() -> Iterator[TestClient]:
    with TestClient(create_app(NOWHERE), base_url=LOCAL) as c:
        yield c


def test_no_token_configured_needs_none_and_farm_errors_keep_the_shape(
    open_app: TestClient,
) -> None:
    r = open_app.get("/v1/models")
    assert r.status_code == 503
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert open_app.get("/healthz").status_code == 503


def test_body_limit_counts_chunked_bodies(open_app: TestClient) -> None:
    def chunks() -> Iterator[bytes]:
        for _ in range(MAX_BODY // 1024 + 1):
            yield b"x" * 1024

    r = open_app.post("/v1/jobs", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = open_app.post(
        "/v1/jobs", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and "error" in r.json()


def test_bad_values_are_refused_by_the_schemas_check(open_app: TestClient) -> None:
    """Ranges come from Param.check (through Farm.submit): the same text as every door."""
    job = {"model": "m", "prompt": "x"}
    r = open_app.post("/v1/jobs", json={**job, "width": 60})
    with pytest.raises(InvalidParameterError) as want:
        BY_NAME["width"].check(60)
    assert r.status_code == 400 and r.json()["error"]["message"] == str(want.value)
    assert r.json()["error"]["param"] == "width"
    r = open_app.post("/v1/jobs", json={**job, "sampler": "nope"})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "sampler")
    r = open_app.post("/v1/jobs", json={**job, "unknown": 1})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "unknown")
    for extra, param in [({"size": "64x4104"}, "size"), ({"n": MAX_BATCH + 1}, "n"),
                         ({"steps": 0}, "steps"), ({"user": "u" * 201}, "user")]:  # fmt: skip
        r = open_app.post("/v1/images/generations", json={**job, **extra})
        assert (r.status_code, r.json()["error"]["param"]) == (400, param), r.json()


def test_tokens_are_required_when_configured() -> None:
    with TestClient(create_app(NOWHERE, tokens=["s3cret"]), base_url=LOCAL) as c:
        assert c.get("/v1/models").json()["error"]["code"] == "missing_api_key"
        r = c.get("/v1/models", headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = c.get("/v1/models", headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 503  # past auth; no Redis there
