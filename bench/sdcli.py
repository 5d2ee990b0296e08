"""The runtime's own CLI (sd-cli, built beside the library by `sdfarm build --with-cli`) for
benchmarks that need a runtime setting our engine does not expose (per-component weight
types through `--tensor-type-rules`) or a process that may abort (its ERROR records go to
stderr unbuffered, so a CUDA error's lines survive the SIGABRT). `python bench/X.py` puts
this folder on sys.path, so scripts import it as `sdcli`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

ROLE_FLAGS = {
    "checkpoint": "--model",
    "diffusion_model": "--diffusion-model",
    "clip_l": "--clip_l",
    "clip_g": "--clip_g",
    "t5xxl": "--t5xxl",
    "llm": "--llm",
    "vae": "--vae",
    "taesd": "--taesd",
}
PROMPT = "a lighthouse on a cliff at dusk, oil painting"
LATENT_RE = re.compile(r"latent (\d+) decoded, taking ([0-9.]+)s")
PHASE_RE = re.compile(r"(\w[\w ()]*?) completed(?:,)? (?:taking|in) ([0-9.]+)\s*s")
SAVED_RE = re.compile(r"save result image (\d+) to '([^']+)' \(success\)")


def stamp() -> str:
    return time.strftime("%H:%M:%S")


def say(*args: Any) -> None:
    print(f"[{stamp()}]", *args, flush=True)


def model_files(model: str | os.PathLike[str]) -> dict[str, str]:
    """{role: path} of a model folder, through our own role detection (no runtime load)."""
    from sdfarm.native.model import Model

    m = Model.from_dir(Path(model))
    return {role: str(mf.path) for role, mf in m.files.items()}


def command(
    cli: str,
    files: dict[str, str],
    size: int,
    out_pattern: str,
    *,
    steps: int = 1,
    seed: int = 42,
    batch_count: int = 1,
    extra: list[str] | None = None,
    threads: int | None = None,
) -> list[str]:
    """sd-cli with our engine's settings on CUDA: cfg 1, flash attention in the diffusion
    model, im2col VAE (no --vae-conv-direct) unless `extra` asks."""
    cmd = [cli]
    for role, path in files.items():
        cmd += [ROLE_FLAGS[role], path]
    cmd += ["-p", PROMPT, "-W", str(size), "-H", str(size), "--steps", str(steps)]
    cmd += ["--seed", str(seed), "--cfg-scale", "1.0", "--diffusion-fa"]
    cmd += ["-t", str(threads or os.cpu_count() or 1)]
    if batch_count != 1:
        cmd += ["--batch-count", str(batch_count)]
    return cmd + list(extra or []) + ["-o", out_pattern]


def env_for(cli: str) -> dict[str, str]:
    """The library sits beside sd-cli (its build folder's rpath is gone when carried)."""
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        p for p in (str(Path(cli).resolve().parent), env.get("LD_LIBRARY_PATH", "")) if p
    )
    return env


def run(cmd: list[str], timeout: float, log_dir: Path, name: str) -> dict[str, Any]:
    """Run sd-cli (stdout line-buffered through stdbuf where there is one, so the INFO lines
    printed before an abort are kept); stdout and stderr go to files in `log_dir`."""
    log_dir.mkdir(parents=True, exist_ok=True)
    full = (["stdbuf", "-oL", "-eL"] if shutil.which("stdbuf") else []) + cmd
    out_p, err_p = log_dir / f"{name}.stdout", log_dir / f"{name}.stderr"
    t = time.perf_counter()
    timed_out = False
    with open(out_p, "w") as fo, open(err_p, "w") as fe:
        proc = subprocess.Popen(full, stdout=fo, stderr=fe, env=env_for(cmd[0]))
        try:
            rc = proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
            timed_out = True
    wall = time.perf_counter() - t
    return {
        "returncode": rc,
        "timed_out": timed_out,
        "wall_s": round(wall, 3),
        "stdout": out_p.read_text(errors="replace"),
        "stderr": err_p.read_text(errors="replace"),
    }


def phases(text: str) -> dict[str, float]:
    """Every "X completed, taking N.NNs" / "completed in N.NNs" of the log, by X (the last)."""
    out: dict[str, float] = {}
    for name, value in PHASE_RE.findall(text or ""):
        out[name.strip()] = float(value)
    return out


def latent_decodes(text: str) -> list[float]:
    """The runtime's "latent i decoded, taking N.NNs" records, in order (10 ms resolution)."""
    return [float(s) for _, s in LATENT_RE.findall(text or "")]


def saved_images(text: str) -> list[str]:
    return [p for _, p in sorted(SAVED_RE.findall(text or ""), key=lambda x: int(x[0]))]


def tail(text: str, n: int = 1500) -> str:
    return (text or "")[-n:]
