"""The runtime's log records: levels, reading the shim's ring, and scrubbing.

Records leave the machine (they travel through Redis to whoever submitted the job), so before
anyone sees them: model file paths become roles (`<diffusion_model file>`), and prompt text is
redacted unless the job opted in (at debug the runtime logs each prompt and its tokens).
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass

LEVELS = {"debug": 0, "info": 1, "warn": 2, "error": 3, "none": 4}
LEVEL_NAMES = {v: k for k, v in LEVELS.items()}
SOURCES = {0: "sd", 1: "ggml", 2: "shim", 3: "engine"}
PREFIX = "stable_diffusion: "
HEADER = struct.Struct("<QIBBH")  # sdf_record_header_t: seq, len, level, source, reserved
RING_BYTES = 256 * 1024

# "model.cpp:403  - message": sd.cpp's location prefix.
_LOCATION = re.compile(r"^([\w.+-]+\.(?:cpp|hpp|h|c)):(\d+)\s*- ")
# Records that carry the prompt or its tokens (tokenizers and conditioners at debug).
_PROMPT_RECORDS = (
    (re.compile(r"^(parse )'.*' to .*$", re.S), r"\1<prompt redacted> to <tokens redacted>"),
    (
        re.compile(r'^(split prompt )".*" to tokens .*$', re.S),
        r"\1<prompt redacted> to tokens <tokens redacted>",
    ),
    (re.compile(r"^((?:negative_)?prompt: ).*$", re.M), r"\1<prompt redacted>"),
)


def level_number(name: str) -> int:
    """`debug`, `info`, `warn`, `error` or `none`; a clear error for anything else."""
    try:
        return LEVELS[name.lower()]
    except (KeyError, AttributeError):
        raise ValueError(f"unknown log level {name!r}; choose one of {', '.join(LEVELS)}") from None


@dataclass(frozen=True)
class LogRecord:
    """One record as users receive it: `seq` numbers records in the order the runtime made
    them (gaps mean records were dropped), `message` starts with `stable_diffusion: `."""

    seq: int
    level: str
    message: str
    source: str = "sd"
    location: str = ""

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def parse_ring(buf: bytes) -> list[tuple[int, int, int, str]]:
    """Decode what sdf_log_drain wrote: (seq, level, source, text) per record."""
    out = []
    pos = 0
    while pos + HEADER.size <= len(buf):
        seq, length, level, source, _ = HEADER.unpack_from(buf, pos)
        pos += HEADER.size
        text = buf[pos : pos + length].decode("utf-8", errors="replace")
        pos += length
        out.append((seq, level, source, text))
    return out


class Scrubber:
    """Replaces model paths with role labels and redacts prompt text.

    `paths` maps an absolute path (a file or the model's folder) to its label; longer paths
    are replaced first, so a file inside the folder keeps its own role."""

    def __init__(
        self, paths: Mapping[str, str], prompts: Iterable[str] = (), log_prompts: bool = False
    ) -> None:
        self._paths = sorted(
            ((p, label) for p, label in paths.items() if p), key=lambda x: -len(x[0])
        )
        # Whole prompts only, on word boundaries, and not tiny ones: a prompt "a" must not eat
        # every "a" in the log. The records that carry prompts are redacted by pattern above.
        texts = (
            []
            if log_prompts
            else sorted(
                {p.strip() for p in prompts if p and len(p.strip()) >= 4}, key=len, reverse=True
            )
        )
        self._prompts = [re.compile(r"(?<!\w)" + re.escape(t) + r"(?!\w)") for t in texts]
        self._log_prompts = log_prompts

    def __call__(self, text: str) -> str:
        for path, label in self._paths:
            if path in text:
                text = text.replace(path, label)
        if self._log_prompts:
            return text
        for pattern, repl in _PROMPT_RECORDS:
            text = pattern.sub(repl, text)
        for prompt in self._prompts:
            text = prompt.sub("<prompt redacted>", text)
        return text


def to_records(raw: Iterable[tuple[int, int, int, str]], scrub: Scrubber) -> list[LogRecord]:
    """Turn drained ring entries into LogRecords: strip sd.cpp's `file.cpp:123 - ` prefix into
    `location`, scrub, and put `stable_diffusion: ` in front."""
    records = []
    for seq, level, source, text in raw:
        location = ""
        m = _LOCATION.match(text)
        if m:
            location = f"{m.group(1)}:{m.group(2)}"
            text = text[m.end() :]
        records.append(
            LogRecord(
                seq,
                LEVEL_NAMES.get(level, "info"),
                PREFIX + scrub(text.strip()),
                SOURCES.get(source, "sd"),
                location,
            )
        )
    return records


def dropped_record(count: int, seq: int, capacity: int) -> LogRecord:
    """The one warning that says how many records the ring lost."""
    return LogRecord(
        seq,
        "warn",
        f"{PREFIX}{count} log records were dropped: the runtime "
        f"logged more than the ring's {capacity} bytes between two reads",
        "engine",
    )


def visible(records: Iterable[LogRecord], level: str, native_level: str) -> list[LogRecord]:
    """A record reaches the user only when it passes both `level` and `native_level`."""
    floor = max(level_number(level), level_number(native_level))
    return [r for r in records if LEVELS[r.level] >= floor and floor < LEVELS["none"]]
