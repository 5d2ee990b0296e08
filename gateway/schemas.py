"""The gateway's request bodies, derived from the job schema (sdfarm.native.params) and the
upscale job's (sdfarm.native.upscale_params).

No parameter is listed here: `JobRequest` and `ImagesRequest` are built with
`pydantic.create_model` from `PARAMS`, `UpscaleRequest` from `UPSCALE_PARAMS` (and each takes
the options priority, submitter and webhook from `OPTIONS`),
so a new generation parameter reaches both endpoints and the OpenAPI document with no change
here. Pydantic checks the types only; the ranges are `Param.check`'s (run by `Farm.submit`), so
a bad value gets the one error text every door gives, and they are written into the JSON
schema so that the document shows them.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from sdfarm.gateway.errors import APIError, validation_error
from sdfarm.native.addresses import MAX_URL_CHARS
from sdfarm.native.errors import InvalidParameterError
from sdfarm.native.params import BY_NAME, IMAGE_PARAMS, OPTIONS, PARAMS, Param
from sdfarm.native.upscale_params import UPSCALE_PARAMS
from sdfarm.native.video_params import VIDEO_IMAGES, VIDEO_PARAMS

CARRIED = ("width", "height", "batch_count")
"""The parameters OpenAI's request carries in `size` and `n`."""
RESPONSE_FORMATS = ("url", "b64_json")
AUTO_SIZE = "auto"
SIZE_RE = r"\s*(\d{1,5})\s*[xX]\s*(\d{1,5})\s*"
DEFAULT_SUBMITTER = "gateway"
_OPTION = {p.name: p for p in OPTIONS}


def schema_rules(p: Param) -> dict[str, Any]:
    """The JSON schema keywords of `p`'s allowed values (ranges, choices, lengths)."""
    if p.kind == "image":
        return {"contentEncoding": "base64"}
    if p.kind in ("images", "loras"):
        return {"maxItems": int(p.hi or 0)}
    if p.kind == "choice":
        return {"enum": list(p.choices)}
    if p.kind == "text":
        return {"maxLength": p.max_chars} if p.max_chars else {}
    if p.kind == "url":
        return {"maxLength": MAX_URL_CHARS}
    if p.lo is None:
        return {}
    rules: dict[str, Any] = {"minimum": p.lo, "maximum": p.hi}
    if p.step:
        rules["multipleOf"] = p.step
    if p.auto is None:
        return rules
    if p.auto == p.lo - 1:  # seed: -1 picks one, so the range simply starts there
        return {**rules, "minimum": p.auto}
    return {"anyOf": [{"const": p.auto}, rules]}


def _field(p: Param, *, help: str | None = None, nullable: bool = False) -> Any:  # noqa: A002
    """(type, FieldInfo) of `p` for create_model; `nullable`: null, the default, means the
    gateway's own value (a text option: the submitter)."""
    rules = schema_rules(p)
    if nullable:
        text = f"{help or p.help} ({p.range_text}; default: {DEFAULT_SUBMITTER})"
        return (p.python_type | None, Field(None, description=text, json_schema_extra=rules))
    text = f"{help or p.help} ({p.range_text})"
    if p.kind == "loras":  # ["name:0.8", ...] or [["name", 0.8], ...] or [{"name", "weight"}]
        return (list[Any], Field([], description=text, json_schema_extra=rules))
    if p.kind in ("image", "images"):  # over JSON, an image is base64 (or a data: URL)
        text = f"{help or p.help} ({p.range_text}), base64"
        if p.required:
            return (str, Field(..., description=text, json_schema_extra=rules))
        kind: Any = str | None if p.kind == "image" else list[str]
        return (kind, Field(p.default if p.kind == "image" else [], description=text,
                            json_schema_extra=rules))  # fmt: skip
    default = ... if p.required else p.default
    return (p.python_type, Field(default, description=text, json_schema_extra=rules))


def _option(name: str, help: str | None = None) -> Any:  # noqa: A002
    p = _OPTION[name]
    return _field(p, help=help, nullable=p.kind == "text")


_MODEL = (str, Field(min_length=1, description="the model's name (GET /v1/models lists them)"))

JobRequest: type[BaseModel] = create_model(
    "JobRequest",
    __config__=ConfigDict(extra="forbid"),
    __doc__="One job: a model, the generation parameters and the job options.",
    model=_MODEL,
    **{p.name: _field(p) for p in PARAMS},
    priority=_option("priority"),
    submitter=_option("submitter", help="the name fair share counts the job for"),
    webhook=_option("webhook"),
)
ImagesRequest: type[BaseModel] = create_model(
    "ImagesRequest",
    __config__=ConfigDict(extra="ignore"),
    __doc__="OpenAI's images/generations body (its other fields, quality and style, are "
    "ignored), with every generation parameter but the ones `size` and `n` carry.",
    model=_MODEL,
    prompt=_field(BY_NAME["prompt"]),
    n=_field(BY_NAME["batch_count"], help="images to make, seeds seed, seed+1, ..."),
    size=(
        str,
        Field(
            f"{BY_NAME['width'].default}x{BY_NAME['height'].default}",
            description=f"WIDTHxHEIGHT, each side {BY_NAME['width'].range_text}",
            json_schema_extra={"pattern": f"^{SIZE_RE}$"},
        ),
    ),
    response_format=(str, Field("url", json_schema_extra={"enum": list(RESPONSE_FORMATS)})),
    user=_option("submitter", help="who fair share counts the job for"),
    **{p.name: _field(p) for p in PARAMS if p.name not in ("prompt", *CARRIED)},
    priority=_option("priority"),
    webhook=_option("webhook"),
)
EditRequest: type[BaseModel] = create_model(
    "EditRequest",
    __config__=ConfigDict(extra="ignore"),
    __doc__="OpenAI's images/edits form fields (its others, quality, background and the like, "
    "are ignored), with every generation parameter but the ones `size` and `n` carry and the "
    "images, which come as the form's files `image` and `mask`.",
    model=_MODEL,
    prompt=_field(BY_NAME["prompt"]),
    n=_field(BY_NAME["batch_count"], help="images to make, seeds seed, seed+1, ..."),
    size=(
        str,
        Field(
            AUTO_SIZE,
            description=f"WIDTHxHEIGHT, each side {BY_NAME['width'].range_text}, or auto: the "
            f"image's size, each side rounded down to a multiple of {BY_NAME['width'].step}",
            json_schema_extra={"pattern": f"^(?:{AUTO_SIZE}|{SIZE_RE})$"},
        ),
    ),
    response_format=(str, Field("url", json_schema_extra={"enum": list(RESPONSE_FORMATS)})),
    user=_option("submitter", help="who fair share counts the job for"),
    **{
        p.name: _field(p)
        for p in PARAMS
        if p.name not in ("prompt", *CARRIED) and p not in IMAGE_PARAMS
    },
    priority=_option("priority"),
)


UpscaleRequest: type[BaseModel] = create_model(
    "UpscaleRequest",
    __config__=ConfigDict(extra="forbid"),
    __doc__="One upscale: the image (base64), the upscaler, the upscale parameters and the job "
    "options.",
    **{p.name: _field(p) for p in UPSCALE_PARAMS},
    priority=_option("priority"),
    submitter=_option("submitter", help="the name fair share counts the job for"),
)


VideoRequest: type[BaseModel] = create_model(
    "VideoRequest",
    __config__=ConfigDict(extra="forbid"),
    __doc__="One video: a (Wan) model, the video parameters (images base64) and the job options.",
    model=_MODEL,
    **{p.name: _field(p) for p in VIDEO_PARAMS},
    priority=_option("priority"),
    submitter=_option("submitter", help="the name fair share counts the job for"),
    webhook=_option("webhook"),
)


def video_args(values: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
    """(model, prompt, the other keyword arguments of Farm.video) of a parsed VideoRequest's
    values: images decoded, the gateway's submitter by default."""
    values = dict(values)
    if values.get("submitter") is None:
        values["submitter"] = DEFAULT_SUBMITTER
    for name in VIDEO_IMAGES:
        if values.get(name) is not None:
            values[name] = decode_image(name, values[name])
    return values.pop("model"), values.pop("prompt"), values


def upscale_args(values: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of Farm.upscale of a parsed UpscaleRequest's values: the image
    decoded, the gateway's submitter by default."""
    values = dict(values)
    if values.get("submitter") is None:
        values["submitter"] = DEFAULT_SUBMITTER
    values["image"] = decode_image("image", values["image"])
    return values


def parse_size(size: str) -> tuple[int, int]:
    """ "WxH" -> (W, H), each checked by the width and height Params; APIError(400,
    param="size") otherwise."""
    m = re.fullmatch(SIZE_RE, size or "")
    if not m:
        raise APIError(
            400, f"invalid size: {size!r} is not WIDTHxHEIGHT", param="size", code="invalid_size"
        )
    try:
        return BY_NAME["width"].check(int(m.group(1))), BY_NAME["height"].check(int(m.group(2)))
    except InvalidParameterError as exc:
        raise APIError(400, str(exc), param="size", code="invalid_parameter") from None


def parse(model: type[BaseModel], body: Any) -> Any:
    """`body` as `model`, or the 400 naming the first bad field."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None


async def json_body(request: Request) -> Any:
    """Dependency: the request's JSON body (validated by the handler, so that authorization
    comes first and every error has OpenAI's shape). The body must be UTF-8 and its text
    valid Unicode: a JSON escape of half a surrogate pair ("\\ud800") cannot be stored or
    given to the engine, so it is refused here, naming the field, not by a worker later."""
    raw = await request.body()
    try:
        text = raw.decode("utf-8") if raw else "null"
    except UnicodeDecodeError as exc:
        raise APIError(
            400,
            f"the body is not valid UTF-8: byte 0x{raw[exc.start]:02x} at offset {exc.start}",
            code="invalid_encoding",
        ) from None
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise APIError(400, f"the body is not JSON: {exc}", code="invalid_json") from None
    bad = _bad_text(doc)
    if bad is not None:
        raise APIError(
            400,
            f"invalid {bad}: the text is not valid Unicode (a lone surrogate escape such as "
            "\\ud800); send UTF-8 text",
            param=bad,
            code="invalid_encoding",
        )
    return doc


def _bad_text(doc: Any, where: str | None = None) -> str | None:
    """The top-level field (or "body") holding a string that is not valid Unicode, or None."""
    if isinstance(doc, str):
        try:
            doc.encode("utf-8")
        except UnicodeEncodeError:
            return where or "body"
        return None
    if isinstance(doc, dict):
        for k, v in doc.items():
            bad = _bad_text(k, where or "body") or _bad_text(v, where or str(k))
            if bad is not None:
                return bad
    elif isinstance(doc, list):
        for v in doc:
            bad = _bad_text(v, where)
            if bad is not None:
                return bad
    return None


def body_doc(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` of a route whose JSON body the handler validates: its requestBody."""
    schema = model.model_json_schema()
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def form_doc(
    model: type[BaseModel], files: dict[str, str], required: tuple[str, ...] = ()
) -> dict[str, Any]:
    """`openapi_extra` of a route whose multipart form the handler validates: `model`'s
    fields as text, plus the `files` (name -> description) as binary parts, the `required`
    ones among them."""
    schema = model.model_json_schema()
    for name, text in files.items():
        schema["properties"][name] = {"type": "string", "format": "binary", "description": text}
    schema["required"] = [*schema.get("required", []), *required]
    content = {"multipart/form-data": {"schema": schema}}
    return {"requestBody": {"required": True, "content": content}}


def submit_args(values: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
    """(model, prompt, the other keyword arguments of Farm.submit) of a parsed request's
    values (`model_dump()`, with OpenAI's fields already turned into parameters)."""
    values = dict(values)
    if values.get("submitter") is None:
        values["submitter"] = DEFAULT_SUBMITTER
    for p in IMAGE_PARAMS:
        value = values.get(p.name)
        if p.kind == "image" and value is not None:
            values[p.name] = decode_image(p.name, value)
        elif p.kind == "images":
            values[p.name] = [decode_image(f"{p.name}[{i}]", v) for i, v in enumerate(value or [])]
    return values.pop("model"), values.pop("prompt"), values


def decode_image(name: str, text: str) -> bytes:
    """An image sent as base64 text (a `data:image/...;base64,` URL too): its bytes, checked by
    the job schema later; InvalidParameterError when it is not base64."""
    if text.startswith("data:"):
        text = text.partition(",")[2]
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidParameterError(
            name, "is not base64 (send the image file's bytes as base64)"
        ) from None
