"""`sdfarm batch FILE --out DIR`: many prompts in, PNGs on disk, resumable.

Input is text (one prompt a line, blank lines and `#` comments skipped), CSV (a header with
`prompt` and optional per-item fields) or JSONL (one object a line). Every item gets a stable
output name (its `name`, else `{index:05d}-{slug}`), so a re-run maps each item to the same
file and skips those already written: an interrupted batch of thousands resumes where it
stopped, and nothing finished is ever paid for twice. A PNG appears only once complete (sidecar
first, then the PNG renamed into place), so its existence is the resume test.

Parsing and the resume decision are pure functions; `run_batch` talks to the farm through a
client object with `submit(model, prompt, **params)` returning jobs with `.result(timeout)`.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import re
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sdfarm.native.params import PARAMS
from sdfarm.store import FINAL_STATES

ITEM_FIELDS: dict[str, type] = {p.name: p.python_type for p in PARAMS if p.name != "prompt"}
"""Per-item fields an input may set (every generation parameter, sdfarm.native.params), with
the type each is converted to; the job schema checks their ranges when the item is queued."""
FORMATS = ("text", "csv", "jsonl")
SLUG_CHARS = 40
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class BatchInputError(ValueError):
    """The input file is malformed; the message names the line."""


@dataclass(frozen=True)
class BatchItem:
    """One prompt to render. `params` holds only the fields the input set; the command's
    flags fill the rest (`merged`)."""

    index: int
    prompt: str
    name: str
    params: dict[str, Any] = field(default_factory=dict)
    line: int = 0

    def merged(self, common: dict[str, Any]) -> dict[str, Any]:
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


def _convert(name: str, value: Any, line: int) -> Any:
    kind = ITEM_FIELDS[name]
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


def _item(index: int, row: dict[str, Any], line: int) -> BatchItem:
    prompt = row.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise BatchInputError(f"line {line}: no prompt")
    params = {}
    for key, value in row.items():
        if key in ITEM_FIELDS and value not in (None, ""):
            params[key] = _convert(key, value, line)
    name = row.get("name")
    if name in (None, ""):
        name = default_name(index, prompt)
    elif not isinstance(name, str) or not NAME_RE.match(name) or name.endswith(".png"):
        raise BatchInputError(
            f"line {line}: name {name!r} is not a plain file name (letters, digits, '.', "
            f"'_', '-'; no extension)"
        )
    return BatchItem(index=index, prompt=prompt.strip(), name=name, params=params, line=line)


def parse_text(text: str) -> list[BatchItem]:
    items = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        items.append(_item(len(items), {"prompt": line}, n))
    return items


def parse_csv(text: str) -> list[BatchItem]:
    dialect = "excel-tab" if "\t" in text.split("\n", 1)[0] else "excel"
    reader = csv.DictReader(io.StringIO(text), dialect=dialect)
    fields = [f.strip() for f in reader.fieldnames or []]
    if "prompt" not in fields:
        raise BatchInputError("line 1: the CSV header has no `prompt` column")
    reader.fieldnames = fields
    unknown = set(fields) - set(ITEM_FIELDS) - {"prompt", "name"}
    if unknown:
        raise BatchInputError(f"line 1: unknown CSV columns {sorted(unknown)}")
    items = []
    for row in reader:
        line = reader.line_num
        if not any((v or "").strip() for v in row.values() if isinstance(v, str)):
            continue
        if (row.get("prompt") or "").lstrip().startswith("#"):
            continue
        clean = {
            k: (v.strip() if isinstance(v, str) and k != "prompt" else v) for k, v in row.items()
        }
        items.append(_item(len(items), clean, line))
    return items


def parse_jsonl(text: str) -> list[BatchItem]:
    items = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise BatchInputError(f"line {n}: not JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise BatchInputError(f"line {n}: expected a JSON object")
        unknown = set(row) - set(ITEM_FIELDS) - {"prompt", "name"}
        if unknown:
            raise BatchInputError(f"line {n}: unknown fields {sorted(unknown)}")
        items.append(_item(len(items), row, n))
    return items


def parse_items(text: str, fmt: str) -> list[BatchItem]:
    """Parse `text` in `fmt` (text, csv, jsonl); duplicate names are an error, since two
    items would write one file and the resume test could not tell them apart."""
    parser = {"text": parse_text, "csv": parse_csv, "jsonl": parse_jsonl}.get(fmt)
    if parser is None:
        raise BatchInputError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    items = parser(text)
    seen: dict[str, int] = {}
    for item in items:
        if item.name in seen:
            raise BatchInputError(
                f"line {item.line}: name {item.name!r} already used on line {seen[item.name]}"
            )
        seen[item.name] = item.line
    return items


def read_items(path: str | os.PathLike[str], fmt: str | None = None) -> list[BatchItem]:
    text = Path(path).read_text(encoding="utf-8-sig")
    return parse_items(text, fmt or detect_format(path))


# -- resuming ------------------------------------------------------------------------------------


def png_path(out_dir: Path, item: BatchItem) -> Path:
    return out_dir / f"{item.name}.png"


def sidecar_path(out_dir: Path, item: BatchItem) -> Path:
    return out_dir / f"{item.name}.json"


def split_done(
    items: Sequence[BatchItem], existing: Iterable[str]
) -> tuple[list[BatchItem], list[BatchItem]]:
    """(to do, skipped): an item is skipped when `{name}.png` is among the existing files.
    Pure, so the decision is tested without a farm or a disk."""
    have = set(existing)
    todo = [i for i in items if f"{i.name}.png" not in have]
    skipped = [i for i in items if f"{i.name}.png" in have]
    return todo, skipped


def existing_files(out_dir: Path) -> set[str]:
    try:
        return {p.name for p in out_dir.iterdir() if p.is_file() and p.stat().st_size > 0}
    except FileNotFoundError:
        return set()


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def write_result(out_dir: Path, item: BatchItem, job_id: str, result: Any) -> Path:
    """The sidecar first, then the PNG: a PNG on disk always has its metadata beside it."""
    sidecar = {
        "name": item.name,
        "prompt": item.prompt,
        "job": job_id,
        "metadata": getattr(result, "metadata", {}),
        "records": getattr(result, "records", []),
    }
    _write_atomically(
        sidecar_path(out_dir, item), json.dumps(sidecar, indent=2, default=str).encode()
    )
    target = png_path(out_dir, item)
    _write_atomically(target, result.png)
    return target


# -- running -------------------------------------------------------------------------------------


@dataclass
class Summary:
    total: int = 0
    done: int = 0
    skipped: int = 0
    submitted: int = 0
    failures: list[dict[str, Any]] = field(default_factory=list)
    total_s: float = 0.0
    render_s: float = 0.0
    out: str = ""
    model: str = ""

    @property
    def failed(self) -> int:
        return len(self.failures)

    @property
    def images_per_s(self) -> float:
        return round(self.done / self.render_s, 3) if self.render_s > 0 and self.done else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "out": self.out,
            "model": self.model,
            "total": self.total,
            "done": self.done,
            "skipped": self.skipped,
            "failed": self.failed,
            "submitted": self.submitted,
            "failures": self.failures,
            "images_per_s": self.images_per_s,
            "total_s": round(self.total_s, 3),
        }

    def text(self) -> str:
        lines = [
            f"{self.done} done, {self.skipped} skipped, {self.failed} failed of {self.total} "
            f"in {self.total_s:.1f} s ({self.images_per_s:.2f} images/s) -> {self.out}"
        ]
        lines += [f"  failed {f['name']}: {f['error']}" for f in self.failures]
        return "\n".join(lines)


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def run_batch(
    farm: Any,
    items: Sequence[BatchItem],
    out_dir: str | os.PathLike[str],
    model: str,
    common: dict[str, Any] | None = None,
    priority: int = 9,
    in_flight: int = 8,
    timeout: float = 3600.0,
    on_progress: Callable[[str, BatchItem, int], None] | None = None,
    submitter: str | None = None,
) -> Summary:
    """Render the items not yet in `out_dir`, keeping at most `in_flight` jobs queued on the
    farm (late binding keeps the rest off the devices anyway; the bound keeps a huge batch
    from filling Redis and the queue limit). Results are collected as they finish, not in
    submission order, so one slow device never holds back writing the others. A failed item
    is recorded and the batch goes on. `on_progress(kind, item, n_done)` sees every outcome."""
    start = time.monotonic()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    common = dict(common or {})
    todo, skipped = split_done(items, existing_files(out))
    summary = Summary(total=len(items), skipped=len(skipped), out=str(out), model=model)
    pending = deque(todo)
    flying: deque[tuple[BatchItem, Any]] = deque()
    finished = 0

    def note(kind: str, item: BatchItem) -> None:
        if on_progress is not None:
            on_progress(kind, item, finished)

    def fail(item: BatchItem, error: str) -> None:
        nonlocal finished
        finished += 1
        summary.failures.append({"name": item.name, "index": item.index, "error": error})
        note("failed", item)

    def collect(item: BatchItem, job: Any) -> None:
        nonlocal finished
        try:
            result = job.result(timeout)
            write_result(out, item, job.id, result)
        except Exception as exc:  # noqa: BLE001 - one item's failure never stops the batch
            fail(item, _error_text(exc))
            return
        finished += 1
        summary.done += 1
        note("done", item)

    render_start = time.monotonic()
    try:
        while pending or flying:
            while pending and len(flying) < in_flight:
                item = pending.popleft()
                kwargs: dict[str, Any] = {"priority": priority}
                if submitter:
                    kwargs["submitter"] = submitter
                try:
                    job = farm.submit(model, item.prompt, **item.merged(common), **kwargs)
                except Exception as exc:  # noqa: BLE001 - invalid params, busy farm: per item
                    fail(item, _error_text(exc))
                    continue
                summary.submitted += 1
                flying.append((item, job))
            if not flying:
                continue
            ready = [(i, j) for i, j in flying if _is_final(j)]
            if not ready:
                ready = [flying[0]]  # block on the oldest: it is the likeliest to end next
            for pair in ready:
                flying.remove(pair)
                collect(*pair)
    except BaseException:
        for _, job in flying:  # nobody will read these: free the farm
            with contextlib.suppress(Exception):
                job.cancel()
        raise
    finally:
        now = time.monotonic()
        summary.render_s = now - render_start
        summary.total_s = now - start
    return summary


def _is_final(job: Any) -> bool:
    try:
        return str(job.state()) in FINAL_STATES
    except Exception:  # noqa: BLE001 - then `result` reports the problem
        return True
