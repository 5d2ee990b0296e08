"""Whether a job's VAE decodes in tiles: one pure decision, made where the job is placed.

A tiled decode bounds the decode's working memory by a tile instead of the whole image
(`ModelFacts.estimate(..., tiled=True)` says by how much), at the cost of a slower decode and,
with some VAEs, faint seams. So the farm tiles only when it must: a job's `vae_tiling` is
`auto` (tile when the untiled estimate does not fit the device's figure), `on` or `off`. The
scheduler decides per device (sdfarm.scheduler.placement), the job record carries the plan to
the worker, whose engine obeys it; an engine run in-process decides the same way from its own
figure. `plan_tiling` is the one rule all of them apply.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sdfarm.native.devices import format_bytes
from sdfarm.native.params import VAE_TILING

CHOICES = VAE_TILING
"""The values of the job parameter `vae_tiling`."""


@dataclass(frozen=True)
class TilingPlan:
    """How a job decodes: `tiled` or not, the estimate it is judged by (the tiled one when
    tiled), and the warning the job's result carries ("" when there is nothing to say: the
    untiled decode fits, or the user chose)."""

    tiled: bool
    estimate: int
    warning: str = ""

    def as_json(self) -> dict[str, Any]:
        return {"tiled": self.tiled, "estimate": self.estimate, "warning": self.warning}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> TilingPlan:
        """The plan of a job record's `tiling` field (ValueError/KeyError when malformed)."""
        return cls(bool(doc["tiled"]), int(doc["estimate"]), str(doc.get("warning") or ""))


def tiling_warning(untiled: int, tiled: int, figure: int) -> str:
    """The warning of a job that tiles because its untiled estimate does not fit."""
    text = (
        f"decoded in tiles: the untiled estimate {format_bytes(untiled)} does not fit this "
        f"device's {format_bytes(figure)}"
    )
    if tiled > figure:
        text += f"; the tiled estimate {format_bytes(tiled)} does not fit either"
    return text


def plan_tiling(untiled: int, tiled: int, choice: str, figure: int | None) -> TilingPlan:
    """The plan of a job whose estimate is `untiled` decoded whole and `tiled` in tiles, for
    a device whose figure is `figure` (bytes; None when no figure is known or checked).

    - `off`: never tiles; `on`: always tiles (the user chose: no warning).
    - `auto`: tiles only when the untiled estimate exceeds the figure and tiling bounds
      something (tiled < untiled); then the job is judged by the tiled estimate even when
      that does not fit either, since it is the least the job could need: the caller refuses
      it or takes a slower path with that figure. Without a figure, nothing to fit: untiled.
    """
    if choice not in CHOICES:
        raise ValueError(f"vae_tiling {choice!r} is not one of {', '.join(CHOICES)}")
    if choice == "off":
        return TilingPlan(False, untiled)
    if choice == "on":
        return TilingPlan(True, tiled)
    if figure is None or untiled <= figure or tiled >= untiled:
        return TilingPlan(False, untiled)
    return TilingPlan(True, tiled, tiling_warning(untiled, tiled, figure))


def least_estimate(untiled: int, tiled: int, choice: str) -> int:
    """The smallest estimate `choice` lets the job run with: what an emptied device must hold
    before the job can ever run there."""
    if choice == "off":
        return untiled
    if choice == "on":
        return tiled
    return min(untiled, tiled)
