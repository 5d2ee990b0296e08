"""Batch input: prompts from text (one a line, blank lines and `#` comments skipped), CSV (a
header with `prompt` and optional per-item fields) or JSONL (one object a line), each item with
a stable output name (its `name`, else `{index:05d}-{slug}`) so a re-run maps it to the same
file. The per-item fields are the job schema's parameters (sdfarm.native.params); a line with
`kind` video takes the video job's instead (sdfarm.client.batch_video), checked when read.
Pure but for a video line's image files: tested without a farm (tests/unit/test_batch_input.py,
tests/unit/test_batch_video.py).

A file is streamed, never read whole: `iter_items` yields one item a line as the batch runs,
and `scan_items` checks the whole file first (every line parses, no name is used twice)
holding 8 bytes per item (a hash of its name), so a 100,000-line file costs the client its
current line, not the file (bench/batch_stream_rss.py).
"""

from __future__ import annotations

import codecs
import csv
import json
import os
import re
from array import array
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from hashlib import blake2b
from pathlib import Path
from typing import Any

from sdfarm.client import batch_video
from sdfarm.client.batch_video import LineError
from sdfarm.native.params import PARAMS

ITEM_FIELDS: dict[str, type] = {p.name: p.python_type for p in PARAMS if p.name != "prompt"}
"""Per-item fields an input may set (every generation parameter, sdfarm.native.params), with
the type each is converted to; the job schema checks their ranges when the item is queued.
An input image is a file path, relative to the batch file's folder (a list of them in JSONL,
`;`-separated in CSV, for reference images); it is read when the item is queued."""
IMAGE_FIELDS = {p.name: p.kind for p in PARAMS if p.kind in ("image", "images")}
LIST_FIELDS = {p.name for p in PARAMS if p.kind == "loras"}
KIND_FIELDS: dict[str, dict[str, type]] = {
    "generate": ITEM_FIELDS,
    "video": {n: p.python_type for n, p in batch_video.VIDEO_FIELDS.items()},
}
"""Each kind of line's fields and their types."""
KIND_IMAGES = {"generate": IMAGE_FIELDS, "video": batch_video.VIDEO_IMAGES}
ALL_FIELDS = {*ITEM_FIELDS, *batch_video.VIDEO_FIELDS, "prompt", "name", "kind"}
"""Every field a line may carry, of one kind or the other."""
FORMATS = ("text", "csv", "jsonl")
SLUG_CHARS = 40
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class BatchInputError(ValueError):
    """The input file is malformed; the message names the line."""


@dataclass(frozen=True)
class BatchItem:
    """One prompt to render: an image (`kind` generate) or a video. `params` holds only the
    fields the input set; the command's flags fill the rest (`merged`; a video line takes
    those a video has)."""

    index: int
    prompt: str
    name: str
    params: dict[str, Any] = field(default_factory=dict)
    line: int = 0
    kind: str = "generate"

    def merged(self, common: dict[str, Any]) -> dict[str, Any]:
        if self.kind == "video":
            common = batch_video.common_fields(common)
        return {**common, **self.params}


def slugify(text: str, limit: int = SLUG_CHARS) -> str:
    """Lowercase words joined by '-', cut at a word boundary near `limit`: readable in `ls`."""
    slug = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    if len(slug) > limit:
        cut = slug[:limit]
        slug = cut.rsplit("-", 1)[0] if "-" in cut[limit // 2 :] else cut
    return slug.strip("-") or "prompt"


def default_name(index: int, prompt: str) -> str:
    return f"{index:05d}-{slugify(prompt)}"


def detect_format(path: str | os.PathLike[str]) -> str:
    suffix = Path(path).suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        return "jsonl"
    if suffix in (".csv", ".tsv"):
        return "csv"
    return "text"


def _convert(name: str, value: Any, line: int, of: str = "generate") -> Any:
    kind = KIND_FIELDS[of][name]
    if name in KIND_IMAGES[of]:
        return _image_paths(name, value, line, KIND_IMAGES[of][name] == "images")
    if name in LIST_FIELDS:  # a JSON list as it is, or `a:0.8;b` in a CSV cell
        return (
            [v.strip() for v in value.split(";") if v.strip()] if isinstance(value, str) else value
        )
    if kind is str:
        if not isinstance(value, str):
            raise BatchInputError(f"line {line}: {name} must be text, got {value!r}")
        return value
    if isinstance(value, bool):
        raise BatchInputError(f"line {line}: {name} must be a number, got {value!r}")
    try:
        if kind is int:
            number = float(value) if isinstance(value, str) and "." in value else value
            if isinstance(number, float) and not number.is_integer():
                raise ValueError
            return int(number)
        return float(value)
    except (TypeError, ValueError):
        raise BatchInputError(
            f"line {line}: {name} must be {'an integer' if kind is int else 'a number'}, "
            f"got {value!r}"
        ) from None


def _image_paths(name: str, value: Any, line: int, many: bool) -> str | list[str]:
    """An image field's path, or paths for a list field (a JSON list, or `a.png;b.png`)."""
    if many and isinstance(value, str):
        value = [v.strip() for v in value.split(";") if v.strip()]
    if many and isinstance(value, list) and all(isinstance(v, str) and v for v in value):
        return value
    if not many and isinstance(value, str) and value:
        return value
    raise BatchInputError(
        f"line {line}: {name} must be {'a list of image paths' if many else 'an image path'}, "
        f"got {value!r}"
    )


def resolve_images(items: list[BatchItem], folder: Path) -> list[BatchItem]:
    """Each item's image paths made absolute, relative to the batch file's `folder`."""

    def absolute(v: str) -> str:
        return str(folder / v)

    out = []
    for item in items:
        params = dict(item.params)
        for name, kind in KIND_IMAGES[item.kind].items():
            if name in params:
                v = params[name]
                params[name] = [absolute(x) for x in v] if kind == "images" else absolute(v)
        out.append(replace(item, params=params))
    return out


def _item(index: int, row: dict[str, Any], line: int) -> BatchItem:
    prompt = row.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise BatchInputError(f"line {line}: no prompt")
    try:
        kind = batch_video.line_kind(row.get("kind"))
    except LineError as exc:
        raise BatchInputError(f"line {line}: {exc}") from None
    fields = KIND_FIELDS[kind]
    params = {}
    for key, value in row.items():
        if key in ("prompt", "name", "kind") or value in (None, ""):
            continue
        if key not in fields:
            raise BatchInputError(
                f"line {line}: {key} is not a field of a {kind} line"
                + (" (a video line's fields are those of sdfarm video)" if kind == "video" else "")
            )
        params[key] = _convert(key, value, line, kind)
    if kind == "video":
        try:
            batch_video.check_line(params)
        except LineError as exc:
            raise BatchInputError(f"line {line}: {exc}") from None
    name = row.get("name")
    if name in (None, ""):
        name = default_name(index, prompt)
    elif not isinstance(name, str) or not NAME_RE.match(name) or name.endswith(".png"):
        raise BatchInputError(
            f"line {line}: name {name!r} is not a plain file name (letters, digits, '.', "
            f"'_', '-'; no extension)"
        )
    return BatchItem(
        index=index, prompt=prompt.strip(), name=name, params=params, line=line, kind=kind
    )


Lines = Iterable[tuple[int, str]]
"""Numbered lines (1-based), line ends removed: what each parser reads."""


def _numbered(text: str) -> Lines:
    return enumerate(text.split("\n"), 1)


def iter_text(lines: Lines) -> Iterator[BatchItem]:
    index = 0
    for n, raw in lines:
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        yield _item(index, {"prompt": line}, n)
        index += 1


def parse_text(text: str) -> list[BatchItem]:
    return list(iter_text(_numbered(text)))


def _csv_line(line: str, n: int, dialect: str) -> list[str]:
    """One physical line as CSV fields. A record never spans lines here: a quote left open
    would otherwise swallow the lines after it into one field (one prompt) without a word."""
    try:
        rows = list(csv.reader([line], dialect=dialect, strict=True))
    except csv.Error as exc:
        if "unexpected end of data" in str(exc):
            raise BatchInputError(
                f"line {n}: a quoted field starts on this line and is not closed on it; close "
                f"the quote (a prompt with a line break belongs in JSONL)"
            ) from None
        raise BatchInputError(f"line {n}: malformed CSV ({exc})") from None
    return rows[0] if rows else []


def parse_csv(text: str) -> list[BatchItem]:
    return list(iter_csv(_numbered(text)))


def iter_csv(lines: Lines) -> Iterator[BatchItem]:
    """A header with `prompt` and optional per-item columns, then a record a line (blank lines
    and lines starting with `#`, before the header too, skipped). Quoting is strict: an
    unclosed quote, text after a closing quote or more values than columns are errors naming
    the line."""
    numbered = (
        (n, line) for n, line in lines if line.strip() and not line.lstrip().startswith("#")
    )
    first = next(numbered, None)
    if first is None:
        raise BatchInputError("line 1: the CSV header has no `prompt` column")
    header_line, header = first
    dialect = "excel-tab" if "\t" in header else "excel"
    fields = [f.strip() for f in _csv_line(header, header_line, dialect)]
    if "prompt" not in fields:
        raise BatchInputError(f"line {header_line}: the CSV header has no `prompt` column")
    unknown = set(fields) - ALL_FIELDS
    if unknown:
        raise BatchInputError(f"line {header_line}: unknown CSV columns {sorted(unknown)}")
    twice = sorted({f for f in fields if fields.count(f) > 1})
    if twice:
        raise BatchInputError(f"line {header_line}: CSV columns {twice} appear more than once")
    index = 0
    for n, line in numbered:
        values = _csv_line(line, n, dialect)
        extra = [v for v in values[len(fields) :] if v.strip()]
        if extra:
            raise BatchInputError(
                f"line {n}: {len(values)} values but {len(fields)} columns; quote a value that "
                f"holds a comma"
            )
        row: dict[str, Any] = dict(zip(fields, values, strict=False))
        if not any(v.strip() for v in row.values()):
            continue
        if (row.get("prompt") or "").lstrip().startswith("#"):
            continue
        clean = {k: (v.strip() if k != "prompt" else v) for k, v in row.items()}
        yield _item(index, clean, n)
        index += 1


def parse_jsonl(text: str) -> list[BatchItem]:
    return list(iter_jsonl(_numbered(text)))


def iter_jsonl(lines: Lines) -> Iterator[BatchItem]:
    index = 0
    for n, raw in lines:
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise BatchInputError(f"line {n}: not JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise BatchInputError(f"line {n}: expected a JSON object")
        unknown = set(row) - ALL_FIELDS
        if unknown:
            raise BatchInputError(f"line {n}: unknown fields {sorted(unknown)}")
        yield _item(index, row, n)
        index += 1


PARSERS: dict[str, Callable[[Lines], Iterator[BatchItem]]] = {
    "text": iter_text,
    "csv": iter_csv,
    "jsonl": iter_jsonl,
}


def parse_items(text: str, fmt: str) -> list[BatchItem]:
    """Parse `text` in `fmt` (text, csv, jsonl); duplicate names are an error, since two
    items would write one file and the resume test could not tell them apart."""
    items = list(_parser(fmt)(_numbered(text)))
    seen: dict[str, int] = {}
    for item in items:
        if item.name in seen:
            raise BatchInputError(
                f"line {item.line}: name {item.name!r} already used on line {seen[item.name]}"
            )
        seen[item.name] = item.line
    return items


def _parser(fmt: str) -> Callable[[Lines], Iterator[BatchItem]]:
    parser = PARSERS.get(fmt)
    if parser is None:
        raise BatchInputError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    return parser


def decode_input(data: bytes) -> str:
    """The file's text: UTF-8 (a leading byte order mark dropped), line ends made `\\n`.
    Invalid UTF-8 is a BatchInputError naming the line and the byte offset in the file."""
    bom = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        text = data[bom:].decode("utf-8")
    except UnicodeDecodeError as exc:
        at = bom + exc.start
        line = data.count(b"\n", 0, at) + 1
        column = at - (data.rfind(b"\n", 0, at) + 1) + 1
        raise BatchInputError(
            f"line {line}: not valid UTF-8 (byte 0x{data[at]:02x} at byte offset {at} of the "
            f"file, byte {column} of the line: {exc.reason}); save the file as UTF-8"
        ) from None
    return text.replace("\r\n", "\n").replace("\r", "\n")


def file_lines(path: str | os.PathLike[str]) -> Iterator[tuple[int, str]]:
    """The file's lines, numbered, read one at a time: as `decode_input` would make them (a
    leading byte order mark dropped, `\r\n` and `\r` ending lines too), with its errors."""
    n = 0
    offset = 0
    with open(path, "rb") as f:
        for physical, raw in enumerate(f, 1):
            skip = len(codecs.BOM_UTF8) if physical == 1 and raw.startswith(codecs.BOM_UTF8) else 0
            try:
                text = raw[skip:].decode("utf-8")
            except UnicodeDecodeError as exc:
                at = offset + skip + exc.start
                raise BatchInputError(
                    f"line {physical}: not valid UTF-8 (byte 0x{raw[skip + exc.start]:02x} at "
                    f"byte offset {at} of the file, byte {at - offset + 1} of the line: "
                    f"{exc.reason}); save the file as UTF-8"
                ) from None
            offset += len(raw)
            text = text[:-2] if text.endswith("\r\n") else text.removesuffix("\n")
            for piece in text.replace("\r", "\n").split("\n"):
                n += 1
                yield n, piece


def iter_items(path: str | os.PathLike[str], fmt: str | None = None) -> Iterator[BatchItem]:
    """The items of a batch file, one at a time as the file is read, their image paths made
    absolute. Names are not checked for duplicates here: `scan_items` does, first."""
    parser = _parser(fmt or detect_format(path))
    folder = Path(path).resolve().parent
    for item in parser(file_lines(path)):
        item = resolve_images([item], folder)[0]
        if item.kind == "video":
            try:
                batch_video.check_images(item.params, folder)
            except LineError as exc:
                raise BatchInputError(f"line {item.line}: {exc}") from None
        yield item


@dataclass
class Scan:
    """What `scan_items` found: how many items, how many of them `todo` said need doing."""

    total: int = 0
    todo: int = 0


def _name_hash(name: str) -> int:
    return int.from_bytes(blake2b(name.encode(), digest_size=8).digest(), "little")


def scan_items(
    path: str | os.PathLike[str],
    fmt: str | None = None,
    todo: Callable[[BatchItem], bool] = lambda item: True,
) -> Scan:
    """Check the whole file before anything is queued, streaming it: BatchInputError for the
    first bad line, or for a name used twice (naming both lines). Holds 8 bytes per item (a
    64-bit hash of each name); a second pass runs only when two hashes meet."""
    import numpy as np

    hashes = array("Q")
    scan = Scan()
    for item in iter_items(path, fmt):
        hashes.append(_name_hash(item.name))
        scan.total += 1
        scan.todo += bool(todo(item))
    ordered = np.sort(np.frombuffer(hashes, dtype=np.uint64))
    same = ordered[1:][ordered[1:] == ordered[:-1]]
    if len(same):
        wanted = {int(h) for h in same}
        seen: dict[str, int] = {}
        for item in iter_items(path, fmt):
            if _name_hash(item.name) not in wanted:
                continue
            if item.name in seen:
                raise BatchInputError(
                    f"line {item.line}: name {item.name!r} already used on line {seen[item.name]}"
                )
            seen[item.name] = item.line
    return scan


def read_items(path: str | os.PathLike[str], fmt: str | None = None) -> list[BatchItem]:
    """The items of a batch file as a list (a small file; a big one is `scan_items`, then
    `iter_items`)."""
    scan_items(path, fmt)
    return list(iter_items(path, fmt))
