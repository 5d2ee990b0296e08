"""Python's side of the shim's log ring: configure it, drain it, and (for tests) flood it.

The ring is process-wide (sd.cpp has one log callback), so an engine drains it under its
native lock right after each load, generation and dispose.
"""

from __future__ import annotations

import threading
from typing import Any

from sdfarm.native import logs

NATIVE_LOCK = threading.Lock()
"""Held around every native call that logs: the runtime's callbacks and the ring are
process-wide, so an engine and an upscaler in one process take turns."""


class LogRing:
    """The shim's ring of the most recent records, numbered, with a dropped counter."""

    def __init__(self, ffi: Any, lib: Any) -> None:
        self._ffi, self._lib = ffi, lib
        self.capacity = logs.RING_BYTES

    @classmethod
    def load(cls, backend: str | None = None) -> LogRing:
        from sdfarm.native.binding import load

        return cls(*load(backend))

    def configure(self, capacity: int, native_level: str) -> None:
        """Clear the ring, size it, and set the lowest level the runtime records (errors are
        always recorded: a failed load's reason comes from them)."""
        self.capacity = capacity
        self._lib.sdf_log_configure(capacity, min(logs.level_number(native_level), 3))

    def drain_raw(self) -> tuple[list[tuple[int, int, int, str]], int]:
        """Every record in the ring, oldest first, and how many were dropped since the last
        drain."""
        ffi, lib = self._ffi, self._lib
        cap = max(self.capacity, 1 << 16) + 64
        buf = ffi.new("uint8_t[]", cap)
        dropped = ffi.new("uint64_t*")
        raw: list[tuple[int, int, int, str]] = []
        total = 0
        while True:
            n = lib.sdf_log_drain(buf, cap, dropped)
            total += int(dropped[0])
            if n == 0:
                return raw, total
            raw.extend(logs.parse_ring(bytes(ffi.buffer(buf, n))))

    def drain(self, scrub: logs.Scrubber) -> list[logs.LogRecord]:
        """Drained records, scrubbed, with one warning first when records were dropped."""
        raw, dropped = self.drain_raw()
        records = logs.to_records(raw, scrub)
        if dropped:
            first = raw[0][0] if raw else 0
            records.insert(0, logs.dropped_record(dropped, first, self.capacity))
        return records

    def flood(self, n: int, level: str = "info") -> None:
        """Test hook: the shim records n numbered records as if the runtime logged them."""
        self._lib.sdf_log_test_flood(n, logs.level_number(level))
