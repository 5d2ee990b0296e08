"""One loaded ESRGAN upscaler: `Upscaler.load`, `upscale`, `dispose`.

The upscaler is an engine of its own kind: the worker's engine cache holds it like a model's
engine (keyed `upscaler:NAME`), the scheduler places its jobs by its own estimate
(`UpscalerFacts`, sdfarm.native.estimate). It shares the engine's machinery: the memory check
at load, the log ring drained and scrubbed under the one native lock, errors quoting the
runtime's records, and poisoning after an out-of-memory or a lost device.

Everything is checked before a native call (the runtime trusts what it is given): the file's
tensors against the network the runtime builds (sdfarm.native.upscalers), the image (format,
size caps, decoded fully, converted to 8-bit RGB), the factor (the runtime ignores it and
always upscales by the model's scale) and the tile size. The runtime takes its tile size when
the context is made, so a job with another tile size makes the context again (the weights
are small: 64 MiB for the 23-block x4 models).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from sdfarm.native import images, logs, memory
from sdfarm.native.devices import HostFigures, backend_name
from sdfarm.native.engine import LogConfig, host_device, poison_reason
from sdfarm.native.errors import (
    EnginePoisonedError,
    GenerationError,
    ModelLoadError,
    ModelTooLargeError,
)
from sdfarm.native.estimate import UpscalerFacts, upscaler_facts, use_conv_direct
from sdfarm.native.model import path_variants
from sdfarm.native.ring import NATIVE_LOCK, LogRing
from sdfarm.native.upscale_params import DEFAULT_TILE, UpscaleParams, check_against, validate
from sdfarm.native.upscalers import UpscalerFile

HOW = "upscaler file + a quarter + 128 MiB + working memory per tile and output pixel"


@dataclass
class UpscaleResult:
    """The upscaled image plus what made it and the records the runtime logged."""

    image: Image.Image
    params: UpscaleParams
    metadata: dict[str, Any]
    records: list[logs.LogRecord] = field(default_factory=list)

    @property
    def images(self) -> list[Image.Image]:
        return [self.image]


class Upscaler:
    """An upscaler file loaded into the runtime. Not thread-safe: one caller at a time."""

    def __init__(self) -> None:
        raise TypeError("use Upscaler.load(file, ...)")

    @classmethod
    def load(
        cls,
        file: UpscalerFile,
        *,
        tile_size: int = DEFAULT_TILE,
        device: str = "auto",
        check_memory: bool = True,
        log: LogConfig | None = None,
        threads: int | None = None,
        figures: HostFigures | Callable[[], HostFigures] | None = None,
        pinned: str | None = None,
        backend: str | None = None,
    ) -> Upscaler:
        """Check memory (the file's resident estimate), load. `file` is a checked file
        (sdfarm.native.upscalers.UpscalerCatalog.load); `figures`, `pinned` and `device`
        as for Engine.load."""
        self = object.__new__(cls)
        self.file = file
        self._log = log or LogConfig()
        logs.level_number(self._log.level)
        logs.level_number(self._log.native)
        self._ctx: Any = None
        self._poisoned: str | None = None
        self._pending: list[logs.LogRecord] = []
        self.native_calls = 0
        figs, planned = host_device(figures, backend, device, pinned)
        self.facts: UpscalerFacts = upscaler_facts(file.size, file.scale, planned.name)
        verdict = memory.check_memory(
            self.facts.resident(), figs, device, pinned=pinned, enabled=check_memory, how=HOW
        )
        memory.raise_if_refused(verdict)
        self._verdict = verdict
        compute = verdict.compute_device or planned
        self.device = compute.name
        self.backend = backend_name(figs)
        self._direct = use_conv_direct(compute.name)
        from sdfarm.native.binding import load as load_binding

        self._ffi, self._lib = load_binding(backend)
        self._ring = LogRing(self._ffi, self._lib)
        self._threads = threads or max(1, (os.cpu_count() or 2))
        label = f"<upscaler {file.name} file>"
        self._paths = {p: label for p in path_variants(file.path)}
        if verdict.action == "warn":
            self._pending.append(_record("warn", verdict.message))
        started = time.monotonic()
        self._open(tile_size)
        self.load_seconds = time.monotonic() - started
        self.warmup_seconds = 0.0
        return self

    # -- native calls --------------------------------------------------------------------

    def _open(self, tile_size: int) -> None:
        """Make the context for `tile_size` (ModelLoadError quoting the runtime's errors)."""
        with NATIVE_LOCK:
            self._ring.configure(self._log.ring_bytes, self._log.native)
            path = self._ffi.new("char[]", str(self.file.path).encode())
            self.native_calls += 1
            ctx = self._lib.new_upscaler_ctx(path, False, self._direct, self._threads, tile_size)
            raw = self._ring.drain(logs.Scrubber(self._paths))
        if ctx == self._ffi.NULL:
            errors = [r.message for r in raw if r.level == "error"]
            raise ModelLoadError(
                f"the runtime could not load upscaler {self.file.name!r}: "
                + ("; ".join(errors) if errors else "no error was logged"),
                role="upscaler",
                records=errors,
            )
        self._pending.extend(raw)
        self._ctx, self.tile_size = ctx, tile_size
        scale = self._lib.get_upscale_factor(ctx)
        if scale != self.file.scale:  # the header check and the runtime must agree
            self.dispose()
            raise ModelLoadError(
                f"upscaler {self.file.name!r}: the runtime built a x{scale} network, the file's "
                f"tensors say x{self.file.scale}",
                role="upscaler",
            )

    def _close(self) -> list[logs.LogRecord]:
        with NATIVE_LOCK:
            self._lib.free_upscaler_ctx(self._ctx)
            self._ctx = None
            return self._ring.drain(logs.Scrubber(self._paths))

    def _run(self, pixels: bytes, width: int, height: int) -> Image.Image | None:
        ffi, lib = self._ffi, self._lib
        buf = ffi.new("uint8_t[]", pixels)
        self.native_calls += 1
        out = lib.upscale(
            self._ctx,
            {"width": width, "height": height, "channel": 3, "data": buf},
            self.file.scale,
        )
        if out.data == ffi.NULL:
            return None
        try:
            if out.width == 0 or out.height == 0 or out.channel != 3:
                return None
            n = out.width * out.height * 3
            return Image.frombytes("RGB", (out.width, out.height), bytes(ffi.buffer(out.data, n)))
        finally:
            lib.free(out.data)

    # -- public API ----------------------------------------------------------------------

    def upscale(
        self,
        params: UpscaleParams | None = None,
        *,
        log: LogConfig | None = None,
        estimate: int | None = None,
        **kwargs: Any,
    ) -> UpscaleResult:
        """Upscale `params` (or keyword arguments of UpscaleParams; `upscaler` defaults to
        this one). `estimate` is the job's estimate as the scheduler placed it; without it
        the upscaler makes it from its own facts. Raises InvalidParameterError before any
        native call, ModelTooLargeError when the estimate exceeds what refuses a load,
        GenerationError quoting the runtime's error records."""
        if params is None:
            params = UpscaleParams(**{"upscaler": self.file.name, **kwargs})
        elif kwargs:
            raise TypeError("pass UpscaleParams or keyword arguments, not both")
        self._check_usable()
        params = check_against(validate(params), self.file.scale)
        if params.upscaler != self.file.name:
            raise ValueError(f"this is upscaler {self.file.name!r}, not {params.upscaler!r}")
        pixels, w, h, alpha = images.rgb(params.image)
        need = estimate or self.estimate_for(w, h, params.tile_size)
        limit = self._verdict.refuse_figure
        if self._verdict.action != "skip" and limit is not None and need > limit:
            raise ModelTooLargeError(
                f"upscaling {w}x{h} in tiles of {params.tile_size} needs an estimated "
                f"{memory.format_bytes(need)}; this host has {memory.format_bytes(limit)} "
                "(a smaller tile_size needs less)",
                need,
                self._verdict.figures,
            )
        cfg = log or self._log
        if params.tile_size != self.tile_size:
            self._pending.extend(self._close())
            self._open(params.tile_size)
        started = time.monotonic()
        with NATIVE_LOCK:
            self._ring.configure(cfg.ring_bytes, cfg.native)
            image = self._run(pixels, w, h)
            raw = self._ring.drain(logs.Scrubber(self._paths))
        seconds = time.monotonic() - started
        records = logs.visible(self._pending + raw, cfg.level, cfg.native)
        self._pending = []
        if image is None:
            errors = [r.message for r in raw if r.level == "error"]
            self._poisoned = poison_reason(errors)
            raise GenerationError(
                "the runtime returned no image"
                + (": " + "; ".join(errors) if errors else " and logged no error"),
                records=errors,
            )
        warnings = [r.message for r in raw if r.level == "warn"]
        if alpha:
            warnings.append("the image's alpha channel was dropped: the upscaler reads RGB")
        if self._verdict.action == "warn":
            warnings.insert(0, self._verdict.message)
        metadata = {
            **params.as_dict(),
            "kind": "upscale",
            "output_size": list(image.size),
            "backend": self.backend,
            "device": self.device,
            "estimate": need,
            "warnings": warnings,
            "timings": {"upscale_s": round(seconds, 4)},
        }
        return UpscaleResult(image, params, metadata, records)

    def estimate_for(self, width: int, height: int, tile_size: int) -> int:
        """This upscaler's estimate of a job (`UpscalerFacts.estimate`)."""
        return self.facts.estimate(width, height, tile_size)

    def drain_load_records(self) -> list[logs.LogRecord]:
        """Records of the load, once."""
        out = logs.visible(self._pending, self._log.level, self._log.native)
        self._pending = []
        return out

    def dispose(self) -> list[logs.LogRecord]:
        """Free the context; returns the records logged since the last drain."""
        raw = self._close() if self._ctx is not None else []
        self._poisoned = self._poisoned or "disposed"
        out = logs.visible(self._pending + raw, self._log.level, self._log.native)
        self._pending = []
        return out

    @property
    def poisoned(self) -> str | None:
        """Why this upscaler refuses work (a GPU error state, or disposed), else None."""
        return self._poisoned

    def _check_usable(self) -> None:
        if self._ctx is None or self._poisoned:
            raise EnginePoisonedError(
                f"upscaler {self.file.name!r} cannot run ({self._poisoned or 'not loaded'}); "
                "load it again"
            )

    def __enter__(self) -> Upscaler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.dispose()


def _record(level: str, text: str) -> logs.LogRecord:
    return logs.LogRecord(0, level, logs.PREFIX + text, "engine")
