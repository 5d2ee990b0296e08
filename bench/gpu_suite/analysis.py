"""The GPU suite's pure parts (tests/unit/test_gpu_suite.py): sd-cli log parsing, medians and
ratios, the farm's efficiency arithmetic, sizes and case lists, the summaries of a child's
result, and the number formats of the tables."""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

GiB = 1 << 30
MiB = 1 << 20
GENERATE_RE = re.compile(r"generate_image completed in\s+([0-9]+(?:\.[0-9]+)?)\s*s")
PHASE_RE = re.compile(
    r"([A-Za-z_][\w ]*?)\s+completed,?\s+(?:in|taking)\s+([0-9]+(?:\.[0-9]+)?)\s*s\b"
)


def parse_generate_seconds(text: str) -> float | None:
    """The runtime's own generate time from its log ("generate_image completed in 0.31s");
    the last one when several generations are in the text, None when absent."""
    found = GENERATE_RE.findall(text or "")
    return float(found[-1]) if found else None


def parse_phase_seconds(text: str) -> dict[str, float]:
    """Every "X completed, taking N.NNs" / "X completed in N.NNs" of the runtime's log, by X
    (the last of each): loading tensors, get_learned_condition, sampling, decode_first_stage,
    generate_image ..."""
    out: dict[str, float] = {}
    for name, value in PHASE_RE.findall(text or ""):
        out[name.strip().split("] ")[-1].strip()] = float(value)
    return out


def median(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def ratio(ours: float | None, theirs: float | None) -> float | None:
    if ours is None or theirs is None or theirs <= 0:
        return None
    return ours / theirs


def within(r: float | None, tolerance: float) -> bool | None:
    """Ours within `tolerance` of theirs: ratio <= 1 + tolerance (faster is always fine)."""
    return None if r is None else r <= 1.0 + tolerance


def gpu_efficiency(generate_s: Sequence[float], workers: int, makespan: float) -> float | None:
    """sum of the runtime's generate times / (workers x makespan): the share of the GPUs'
    time spent generating."""
    if workers <= 0 or makespan <= 0:
        return None
    return sum(generate_s) / (workers * makespan)


def per_second(count: float, seconds: float | None) -> float | None:
    return None if not seconds or seconds <= 0 else count / seconds


def added_per_job(farm_wall: float, baseline_wall: float, jobs: int) -> float | None:
    """What the farm adds to each job of a batch, against the in-process loop of the same
    jobs (both walls from first submit/generation to last result)."""
    return None if jobs <= 0 else (farm_wall - baseline_wall) / jobs


def parse_sizes(text: str) -> list[tuple[int, int]]:
    """ "512,1024" or "512x768,1024" -> [(512, 512), (1024, 1024)] / [(512, 768), ...]."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if "x" in part.lower():
            w, h = part.lower().split("x", 1)
            out.append((int(w), int(h)))
        else:
            out.append((int(part), int(part)))
    if not out:
        raise ValueError(f"no sizes in {text!r}")
    return out


def parse_ints(text: str) -> list[int]:
    return [int(p) for p in text.split(",") if p.strip()]


def speed_cases(
    sizes: Sequence[tuple[int, int]], steps: Sequence[int]
) -> list[tuple[int, int, int]]:
    """(width, height, steps): every size at the first step count, then the first size at
    each further step count: 512,1024 x 1,4 -> 512x1, 1024x1, 512x4."""
    first = steps[0]
    cases = [(w, h, first) for w, h in sizes]
    cases += [(sizes[0][0], sizes[0][1], k) for k in steps[1:] if k != first]
    return cases


def size_label(w: int, h: int, steps: int | None = None) -> str:
    return f"{w}x{h}" + (f" {steps} step{'s' if steps != 1 else ''}" if steps else "")


def compare_with_smi(
    reports: dict[str, dict[str, Any]], smi: list[dict[str, Any]] | str
) -> dict[str, list[dict[str, Any]]]:
    """Each runtime's GPUs (in listing order) against nvidia-smi's (in index order): free and
    total in MiB and their differences (ggml - nvidia-smi)."""
    out: dict[str, list[dict[str, Any]]] = {}
    if not isinstance(smi, list):
        return out
    for label, rep in reports.items():
        gpus = [d for d in rep.get("devices", []) if d.get("type") in ("gpu", "igpu")]
        rows = []
        for d, g in zip(gpus, smi, strict=False):
            free, total = d["free"] // MiB, d["total"] // MiB
            rows.append(
                {
                    "name": d["name"],
                    "smi_index": g["index"],
                    "ggml_free_mib": free,
                    "ggml_total_mib": total,
                    "smi_free_mib": g["free_mib"],
                    "smi_total_mib": g["total_mib"],
                    "free_diff_mib": free - g["free_mib"],
                    "total_diff_mib": total - g["total_mib"],
                }
            )
        out[label] = rows
    return out


def huge_apparent_bytes(gpu_totals: Sequence[int], mem_available: int | None) -> int:
    """A model size whose estimate is far above every GPU plus MemAvailable (at least 200 GB,
    the tests' huge model)."""
    base = sum(gpu_totals) + (mem_available or 0)
    want = max(200 * 10**9, int(base * 1.5))
    return want - want % 256


def above_estimate(rows: Sequence[dict[str, Any]], keys: Sequence[str]) -> list[dict[str, Any]]:
    """Every (row, measure) whose value exceeds the row's estimate."""
    out = []
    for row in rows:
        est = row.get("estimate")
        for k in keys:
            v = row.get(k)
            if est and v is not None and v > est:
                out.append(
                    {
                        "case": row.get("case"),
                        "measure": k,
                        "value": v,
                        "estimate": est,
                        "ratio": v / est,
                    }
                )
    return out


def child_status(res: dict[str, Any]) -> dict[str, Any]:
    """How the child ended: its exit code, whether dispose returned, the stderr of a crash."""
    out: dict[str, Any] = {"returncode": res.get("returncode"), "disposed": res.get("disposed")}
    if res.get("returncode"):
        out["crashed"] = True
        out["stderr_tail"] = res.get("stderr_tail", "")[-1500:]
    return out


def load_summary(res: dict[str, Any], label: str) -> dict[str, Any]:
    """A load child's result in brief: the verdict, the engine's warn records and whether the
    first names the device, the estimate and the figure (by their byte counts)."""
    caps = res.get("capabilities") or {}
    recs = res.get("load_records") or []
    warn = [r for r in recs if r.get("source") == "engine" and r.get("level") == "warn"]
    summary: dict[str, Any] = {
        "runtime": label,
        "memory_check": caps.get("memory_check"),
        "device": caps.get("device"),
        "estimate": caps.get("estimate"),
        "figures": caps.get("figures"),
        "fit_plan": caps.get("fit_plan"),
        "engine_warnings": [r.get("message") for r in warn],
        "warn_records": len(warn),
        "runtime_warn_records": len([r for r in recs if r.get("source") != "engine"]),
        "load_s": res.get("load_s"),
        "gens": res.get("gens"),
        "error": res.get("error"),
        "gpu": res.get("gpu"),
        "peak_rss": res.get("peak_rss"),
        **child_status(res),
    }
    if warn and caps:
        msg = warn[0].get("message", "")
        summary["warning_names_device"] = bool(caps.get("device")) and caps["device"] in msg
        summary["warning_names_estimate"] = f"({caps.get('estimate')} bytes)" in msg
        figure = (caps.get("figures") or {}).get(
            next((k for k in caps.get("figures") or {} if k.startswith(caps["device"] + " ")), "")
        )
        summary["warning_names_figure"] = figure is not None and f"({figure} bytes)" in msg
    return summary


def rules_summary(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """The verdicts in brief: every load (check, warn records, what the warning names, the fit
    plan, whether the generation ran), the figures' drop under the holder, the refusal."""
    out: dict[str, Any] = {"loads": [], "figure_drop": {}, "huge_refused": None}
    for c in cases:
        name = c.get("case", "")
        if name.startswith("load full-size") and c.get("ok"):
            g = (c.get("gens") or [{}])[0]
            out["loads"].append(
                {
                    "case": name,
                    "memory_check": c.get("memory_check"),
                    "warn_records": c.get("warn_records"),
                    "names_device": c.get("warning_names_device"),
                    "names_estimate": c.get("warning_names_estimate"),
                    "names_figure": c.get("warning_names_figure"),
                    "fit_plan": (c.get("fit_plan") or {}).get("summary"),
                    "generate_s": g.get("generate_s"),
                    "error": (c.get("error") or g.get("error") or {}).get("message"),
                    "returncode": c.get("returncode"),
                }
            )
        if c.get("figure_drop"):
            out["figure_drop"][name] = c["figure_drop"]
        if name.startswith("huge model") and c.get("ok"):
            out["huge_refused"] = c.get("refused")
    return out


def _plan_text(fp: dict[str, Any]) -> str:
    keys = ("keep_clip_on_cpu", "keep_vae_on_cpu", "offload_params_to_cpu", "max_vram")
    return ", ".join(f"{k}={fp.get(k)}" for k in keys if k in fp) or json.dumps(fp)[:120]


def fmt_s(v: float | None, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def fmt_gib(v: float | None) -> str:
    return "-" if v is None else f"{v / GiB:.2f}"


def fmt_mib(v: float | None) -> str:
    return "-" if v is None else f"{v / MiB:.0f}"
