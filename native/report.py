"""`sdfarm devices`: this host's devices, figures and device choices as one document."""

from __future__ import annotations

from typing import Any

from sdfarm.native.devices import HostFigures, backend_name, choose_compute_device, gpu_figure
from sdfarm.native.probe import figures_to_json, read_host_figures


def devices_report(backend: str | None = None, figs: HostFigures | None = None) -> dict[str, Any]:
    """Figures are read in a subprocess (the runtime is never initialised here)."""
    figs = figs or read_host_figures(backend)
    doc = figures_to_json(figs)
    for d, dev in zip(doc["devices"], figs.devices, strict=True):
        d["figure"] = dev.free if dev.type == "cpu" else gpu_figure(dev)
    choice = {}
    for c in ("auto", "gpu", "cpu"):
        try:
            choice[c] = choose_compute_device(figs, c).name
        except ValueError:
            choice[c] = None
    doc["choice"] = choice
    doc["backend"] = backend_name(figs)
    from sdfarm.native.build import SOURCES

    doc["sd_version"] = SOURCES["sd_version"]
    return doc
