"""Model conversion: a model of the catalog written again in another weight type, as a new
model folder beside it (`sdfarm convert MODEL --type q8_0`), so a model that does not fit a
device can be made to fit.

How a model is converted:
- Each role's file is converted on its own, through the runtime's `convert` (the same code as
  `sd-cli -M convert`), to `<stem>.gguf`: GGUF is the one format that holds every type the
  runtime writes (its safetensors writer holds only float types). Tensor names are kept as
  they are (`convert_name` false): our role detection reads them and the runtime renames them
  per role when it loads the file, as it does for the source.
- The VAE and the TAESD are copied unchanged: the decoder's convolutions are what the runtime
  keeps in f16 anyway (it converts no bias, norm scale or embedding, and a row that is not a
  whole number of blocks), they are a small part of a model (84M of SD 2.x's 1.3G parameters)
  and a quantized decoder costs image quality in every pixel; a user who wants one quantized
  converts it as its own file. A checkpoint (one file holding every part) keeps its VAE
  tensors in their own type by a tensor rule (`^(first_stage_model|vae)\\.=TYPE`) after the
  user's rules.
- The runtime also quantizes what it should: tensors whose rows are not a whole number of
  blocks stay in their type (q8_0 and the legacy types need rows of 32, the k-quants of 256),
  so a k-quant converts fewer tensors of a small model than q8_0 does.

Everything a user gives is checked before any native call (the type against the runtime's
`sd_type_t` names, the model name inside the models folders, the output folder, every file's
header through `Model.from_dir`, the rules' patterns and types). The runtime then runs in a
child process: it aborts its process on some inputs (an uncaught C++ exception on a bad
regular expression, 283 asserts in its source), so a crash costs the command, not the caller,
and is reported with the child's signal. The runtime builds a whole file's result in memory
before it writes it: converting the 1.46 GB q4_0 SD 1.x test checkpoint to q4_1 (1.48 GB)
peaked at 1.65 GB RSS in 65 s on 2 cores. So the memory and disk it needs are worked out from
the headers first (`convert_need`, sdfarm.native.convertmem) and a host that cannot hold them
is refused before the child starts. A child the kernel kills for memory is reported as
such. The files are written into a hidden folder beside
the source (`.NAME.converting-PID`, which the catalog never lists: names start with a letter
or digit) that is renamed into place only when every file converted and its headers read
back as a model; on any failure it is removed, so no half-written model folder survives.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sdfarm.native.catalog import ASSET_FOLDERS, NAME, Catalog, model_dirs
from sdfarm.native.convertmem import (
    CONVERT_BASE,
    HEADER_MARGIN,
    ConvertNeed,
    DiskProbe,
    MemoryProbe,
    disk_free,
    host_available_memory,
    loader_threads,
    output_bytes,
    refusal,
    working_bytes,
)
from sdfarm.native.errors import EngineError, InvalidParameterError, ModelTooLargeError
from sdfarm.native.model import MANIFEST_NAME, Model

# sd_type_t of master-596 (include/stable-diffusion.h): the types `convert` can write, name ->
# value. The child checks each value against the runtime's own `sd_type_name` before it calls
# `convert`. Left out: q8_1 and q8_k (ggml has no row quantizer for them: the runtime would
# abort), the integer and f64 types (no model weights), the iq1/iq2/iq3 types (they need an
# importance matrix; the runtime passes a dummy one of ones, which wrecks them) and tq1_0,
# tq2_0, mxfp4, nvfp4 (ternary and 4-bit float formats for models trained for them).
TYPES: dict[str, int] = {
    "f32": 0,
    "f16": 1,
    "bf16": 30,
    "q8_0": 8,
    "q5_0": 6,
    "q5_1": 7,
    "q4_0": 2,
    "q4_1": 3,
    "q2_k": 10,
    "q3_k": 11,
    "q4_k": 12,
    "q5_k": 13,
    "q6_k": 14,
    "iq4_nl": 20,
    "iq4_xs": 23,
}


def runtime_name(t: str) -> str:
    """ggml's spelling of a type (`q4_K`): what the runtime's tensor rules must say."""
    return t[:-1] + "K" if t.endswith("_k") else t


KEPT_ROLES = ("vae", "taesd")
"""Roles whose files are copied unchanged (see the module's docstring)."""
CHECKPOINT_VAE_PATTERN = r"^(first_stage_model|vae)\."
CHILD_TIMEOUT_S = 3600.0


class ConversionError(EngineError):
    """The runtime's conversion failed or its process died; quotes its error records."""

    def __init__(self, message: str, records: list[str] | None = None) -> None:
        super().__init__(message)
        self.records = records or []


@dataclass(frozen=True)
class FilePlan:
    """One file of the new model: its role, the source, the new file's name, and how it is
    made ("convert" to `type` with `rules`, or "copy")."""

    role: str
    source: Path
    target: str
    action: str
    type: str = ""
    rules: str = ""


@dataclass
class ConvertPlan:
    """What `convert_model` will do, checked: the source model, the new folder, the files."""

    model: Model
    type: str
    out_dir: Path
    files: list[FilePlan] = field(default_factory=list)


def check_type(name: str) -> str:
    """The type name, lower-cased; InvalidParameterError listing the valid ones otherwise."""
    t = str(name).strip().lower()
    if t not in TYPES:
        raise InvalidParameterError(
            "type", f"{name!r} is not a type the runtime converts to; types: {', '.join(TYPES)}"
        )
    return t


def check_rules(rules: str) -> list[tuple[str, str]]:
    """`PATTERN=TYPE,...` as the runtime parses it, checked: each item has a `=`, a pattern
    that compiles and a known type (the runtime ignores a bad item with a warning, and a
    pattern its std::regex cannot compile aborts it). Patterns with a comma cannot be given
    (the runtime splits on commas)."""
    out = []
    for item in (rules or "").split(","):
        if not item:
            continue
        pattern, eq, tname = item.rpartition("=")
        if not eq or not pattern:
            raise InvalidParameterError(
                "tensor_type_rules", f"{item!r} is not PATTERN=TYPE (e.g. '^vae\\.=f16')"
            )
        try:
            re.compile(pattern)
        except re.error as exc:
            raise InvalidParameterError(
                "tensor_type_rules", f"pattern {pattern!r} does not compile ({exc})"
            ) from None
        if "\x00" in pattern:
            raise InvalidParameterError("tensor_type_rules", "a pattern holds a NUL byte")
        if tname.strip().lower() not in TYPES:
            raise InvalidParameterError(
                "tensor_type_rules", f"type {tname!r} is not one of: {', '.join(TYPES)}"
            )
        out.append((pattern, tname.strip().lower()))
    return out


def plan(
    model: str,
    type: str,
    dirs: list[str] | tuple[str, ...] = (),
    out: str | None = None,
    rules: str = "",
) -> ConvertPlan:
    """The checked plan of converting model `model` (a name inside the models folders) to
    `type` as the new model `out` (default `{model}-{type}`) beside it. Raises
    InvalidParameterError or ModelLoadError before anything is written."""
    t = check_type(type)
    user_rules = check_rules(rules)
    cat = Catalog(model_dirs(dirs))
    if not cat.dirs:
        raise InvalidParameterError("models", "no models folder given (--models or $SDFARM_MODELS)")
    source = cat.path(model)  # a plain name inside a models folder, or ModelLoadError
    m = Model.from_dir(source)  # every file's header and role checked
    name = out if out is not None else f"{source.name}-{t}"
    if not NAME.match(name) or name in ASSET_FOLDERS:
        raise InvalidParameterError(
            "out", f"{name!r} is not a model name (letters, digits, '.', '_', '-')"
        )
    out_dir = source.parent / name
    if os.path.lexists(out_dir):
        raise InvalidParameterError(
            "out", f"model folder {name} already exists: remove it or give --out another name"
        )
    files: list[FilePlan] = []
    targets: set[str] = set()
    for role, mf in m.files.items():
        if role in KEPT_ROLES:
            target, action, rule_text = mf.path.name, "copy", ""
        else:
            target, action = f"{mf.path.stem}.gguf", "convert"
            items = list(user_rules)
            if role == "checkpoint":
                items.append((CHECKPOINT_VAE_PATTERN, _vae_type(mf.header)))
            rule_text = ",".join(f"{p}={runtime_name(ty)}" for p, ty in items)
        if target in targets:  # x.safetensors and x.gguf in one model
            target = f"{role}-{target}"
        targets.add(target)
        files.append(FilePlan(role, mf.path, target, action, t if action == "convert" else "",
                              rule_text))  # fmt: skip
    return ConvertPlan(m, t, out_dir, files)


def _vae_type(header: Any) -> str:
    """The type a checkpoint's VAE tensors keep: theirs when they share one the runtime
    writes, else f16."""
    types = {
        info.dtype.lower()
        for n, info in header.tensors.items()
        if re.match(CHECKPOINT_VAE_PATTERN, n) and len(info.shape) > 1
    }
    return types.pop() if len(types) == 1 and next(iter(types), "") in TYPES else "f16"


def convert_need(p: ConvertPlan, threads: int | None = None) -> ConvertNeed:
    """The memory and disk converting `p` needs, from its files' headers, with the runtime's
    loader on `threads` threads (default: its own choice, the physical cores);
    sdfarm.native.convertmem says the rule and how it was measured."""
    n = threads or loader_threads()
    results, peaks = [], []
    for f in p.files:
        if f.action != "convert":
            continue
        header, rules = p.model.files[f.role].header, check_rules(f.rules)
        results.append(output_bytes(header, f.type, rules))
        peaks.append(results[-1] + working_bytes(header, f.type, rules, n))
    copied = sum(p.model.files[f.role].size for f in p.files if f.action == "copy")
    memory = max(peaks) + CONVERT_BASE if peaks else 0
    return ConvertNeed(memory, sum(results) + HEADER_MARGIN * len(results) + copied)


def convert_model(
    p: ConvertPlan,
    timeout: float = CHILD_TIMEOUT_S,
    *,
    available_memory: MemoryProbe = host_available_memory,
    free_disk: DiskProbe = disk_free,
) -> dict[str, Any]:
    """Carry out a checked plan: refuse it when this host's available memory
    (`available_memory`) or the output disk's free bytes (`free_disk`) cannot hold what it
    needs (convert_need), else convert in a child process into a hidden folder, read the
    result back as a model, rename it into place. Returns what was done: sizes, times, the new
    model's name and folder. On any failure the hidden folder is removed."""
    need = convert_need(p)
    memory, disk = available_memory(), free_disk(str(p.out_dir.parent))
    if why := refusal(need, memory, disk):
        raise ModelTooLargeError(
            f"cannot convert model {p.model.name} to {p.type}: {why}",
            need.memory,
            {"MemAvailable": memory, "disk free": disk},
        )
    tmp = p.out_dir.parent / f".{p.out_dir.name}.converting-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    t0 = time.monotonic()
    try:
        jobs = []
        for f in p.files:
            if f.action == "copy":
                shutil.copyfile(f.source, tmp / f.target)
            else:
                jobs.append({"input": str(f.source), "output": str(tmp / f.target),
                             "type": f.type, "value": TYPES[f.type], "rules": f.rules})  # fmt: skip
        child = run_child(jobs, p, timeout)
        manifest = {
            "files": {f.role: f.target for f in p.files},
            "native_size": list(p.model.native_size),
            "converted_from": {"model": p.model.name, "type": p.type},
        }
        (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
        Model.from_dir(tmp)  # the new files' headers and roles, before the folder is visible
        if os.path.lexists(p.out_dir):
            raise InvalidParameterError("out", f"model folder {p.out_dir.name} appeared meanwhile")
        os.rename(tmp, p.out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    new = Model.from_dir(p.out_dir)
    return {
        "model": new.name,
        "source": p.model.name,
        "type": p.type,
        "folder": str(p.out_dir),
        "files": [
            {
                "role": f.role,
                "file": f.target,
                "action": f.action,
                "before": p.model.files[f.role].size,
                "after": new.files[f.role].size,
            }
            for f in p.files
        ],
        "bytes_before": p.model.total_bytes,
        "bytes_after": new.total_bytes,
        "convert_s": round(time.monotonic() - t0, 3),
        "need": {"memory": need.memory, "disk": need.disk},
        "child": child,
    }


def _scrub(text: str, p: ConvertPlan, tmp_prefix: str) -> str:
    """Paths out of a runtime record: the source files become their roles, the new files their
    names."""
    for f in p.files:
        text = text.replace(str(f.source), f"<{f.role} file>")
    return re.sub(re.escape(tmp_prefix) + r"[^/\s']*/", "", text)


def run_child(jobs: list[dict[str, Any]], p: ConvertPlan, timeout: float) -> dict[str, Any]:
    """Run `jobs` in `python -m sdfarm.native.convert`; its last stdout line is a JSON result.
    A child killed by a signal (the runtime aborted) or a failed conversion raise
    ConversionError with the runtime's error records."""
    if not jobs:
        return {"records": []}
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        done = subprocess.run(
            [sys.executable, "-m", "sdfarm.native.convert"],
            input=json.dumps(jobs), capture_output=True, text=True, timeout=timeout, env=env,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        raise ConversionError(f"the conversion ran over {timeout:.0f} s and was stopped") from None
    tmp_prefix = str(p.out_dir.parent / f".{p.out_dir.name}.converting-")
    lines = done.stdout.strip().splitlines()
    try:
        doc = json.loads(lines[-1]) if lines else {}
    except json.JSONDecodeError:
        doc = {}
    records = [_scrub(r, p, tmp_prefix) for r in doc.get("records", [])]
    if done.returncode < 0:
        sig = -done.returncode
        try:
            signame = signal.Signals(sig).name
        except ValueError:
            signame = f"signal {sig}"
        tail = _scrub(done.stderr.strip()[-500:], p, tmp_prefix)
        if sig == signal.SIGKILL:  # the runtime holds the whole converted file in memory
            tail = tail or "probably out of memory: the conversion holds a whole file's result"
        raise ConversionError(
            f"the runtime's convert killed its process with {signame} (the caller is unharmed; "
            f"nothing was written){': ' + tail if tail else ''}",
            records,
        )
    if done.returncode != 0 or not doc.get("ok"):
        what = doc.get("error") or _scrub(done.stderr.strip()[-500:], p, tmp_prefix)
        raise ConversionError(
            f"the runtime could not convert model {p.model.name}: {what or 'no reason given'}"
            + (f" ({records[-1]})" if records else ""),
            records,
        )
    return {**doc, "records": records}


def _child_main() -> int:
    """The child: read the jobs (JSON) from stdin, convert each through the runtime, print
    one JSON line. The runtime's records go to the shim's ring (warnings and errors)."""
    jobs = json.loads(sys.stdin.read())
    from sdfarm.native.binding import load
    from sdfarm.native.logs import LEVEL_NAMES, RING_BYTES
    from sdfarm.native.ring import LogRing

    ffi, lib = load()
    ring = LogRing(ffi, lib)
    ring.configure(RING_BYTES, "warn")
    out: dict[str, Any] = {"ok": True, "files": [], "records": []}
    for job in jobs:
        name = ffi.string(lib.sd_type_name(job["value"])).decode()
        if name.lower() != job["type"]:
            out.update(ok=False, error=f"the runtime names type {job['value']} {name!r}, "
                                       f"not {job['type']!r}")  # fmt: skip
            break
        t0 = time.monotonic()
        ok = lib.convert(
            job["input"].encode(), ffi.NULL, job["output"].encode(), job["value"],
            job["rules"].encode(), False,
        )  # fmt: skip
        raw, _ = ring.drain_raw()
        out["records"] += [f"[{LEVEL_NAMES.get(lv, lv)}] {msg.strip()}" for _, lv, _, msg in raw]
        out["files"].append({"output": Path(job["output"]).name,
                             "seconds": round(time.monotonic() - t0, 3)})  # fmt: skip
        if not ok:
            out.update(ok=False, error=f"convert returned false for {Path(job['input']).name}")
            break
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
    return 0 if out["ok"] else 1


def estimates(
    model_dir: Path, source_dir: Path | None = None, backend: str | None = None
) -> list[dict[str, Any]]:
    """The new model's estimate at its native size on each of this host's devices (and the
    source's, `estimate_before`), beside the device's figure (what the memory check compares
    an estimate with), as `sdfarm devices` reads them: in a subprocess, the runtime is never
    initialised here."""
    from sdfarm.native.devices import gpu_figure
    from sdfarm.native.estimate import model_facts
    from sdfarm.native.probe import read_host_figures

    model = Model.from_dir(model_dir)
    source = Model.from_dir(source_dir) if source_dir is not None else None
    out = []
    for dev in read_host_figures(backend).devices:
        est = model_facts(model, dev).estimate(*model.native_size)
        figure = dev.free if dev.type == "cpu" else gpu_figure(dev)
        row: dict[str, Any] = {"device": dev.name, "estimate": est, "figure": figure,
                               "fits": figure is not None and est <= figure}  # fmt: skip
        if source is not None:
            before = model_facts(source, dev).estimate(*source.native_size)
            row["estimate_before"] = before
            row["fitted_before"] = figure is not None and before <= figure
        out.append(row)
    return out


if __name__ == "__main__":
    sys.exit(_child_main())
