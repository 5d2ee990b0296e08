"""Where the SD-2 UNet aborts on CUDA (issue #12, docs/crashers.md): one sd-cli child per
square size, 1 step, VAE tiling on (so the VAE is not the cause), our engine's settings
otherwise (flash attention in the diffusion model, cfg 1). Each child may die; its exit
status, the CUDA error lines it printed on stderr and the last runtime phase it reached are
recorded. Optional extra cases repeat a size without flash attention.

    python bench/cuda_size_limit.py --cli SD_CLI --model DIR --sizes 1024,1280,1536,1792,2048 \
        [--no-fa-sizes 2048] [--deadline 90] --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import sdcli

ERROR_RE = re.compile(r"error|abort|cuda|ggml_|failed|out of memory", re.IGNORECASE)


def signal_name(rc: int) -> str | None:
    if rc < 0:
        try:
            return signal.Signals(-rc).name
        except ValueError:
            return f"signal {-rc}"
    return None


def case(cli: str, files: dict[str, str], size: int, fa: bool, timeout: float, tmp: Path) -> dict:
    name = f"size-{size}" + ("" if fa else "-nofa")
    extra = ["--vae-tiling", "--vae-tile-size", "32x32"]
    cmd = sdcli.command(cli, files, size, str(tmp / f"{name}.png"), extra=extra)
    if not fa:
        cmd.remove("--diffusion-fa")
    r = sdcli.run(cmd, timeout, tmp / "logs", name)
    err_lines = [ln for ln in r["stderr"].splitlines() if ERROR_RE.search(ln)]
    ph = sdcli.phases(r["stdout"])
    ok = r["returncode"] == 0 and bool(sdcli.saved_images(r["stdout"]))
    reached = [k for k in ("get_learned_condition", "sampling", "decode_first_stage") if k in ph]
    out = {
        "size": size,
        "latent_tokens": (size // 8) ** 2,  # the UNet's first attention level
        "flash_attention": fa,
        "vae_tiling": True,
        "passed": ok,
        "returncode": r["returncode"],
        "signal": signal_name(r["returncode"]),
        "timed_out": r["timed_out"],
        "wall_s": r["wall_s"],
        "phases_s": ph,
        "completed_phases": reached,
        "cuda_error_lines": err_lines[:40],
        "stderr_tail": sdcli.tail(r["stderr"], 2500),
        "stdout_tail": sdcli.tail(r["stdout"], 1200),
        "command": cmd,
    }
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cli", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--sizes", default="1024,1280,1536,1792,2048")
    p.add_argument("--no-fa-sizes", default="", help="sizes to repeat without flash attention")
    p.add_argument("--deadline", type=float, default=120.0, help="seconds for the whole run")
    p.add_argument("--case-timeout", type=float, default=90.0)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    t0 = time.monotonic()
    files = sdcli.model_files(args.model)
    plan = [(int(s), True) for s in args.sizes.split(",") if s]
    plan += [(int(s), False) for s in args.no_fa_sizes.split(",") if s]
    doc: dict[str, Any] = {
        "bench": "cuda_size_limit",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "model": str(Path(args.model).resolve()),
        "settings": "sd-cli, 1 step, cfg 1, seed 42, --vae-tiling (32x32 latent tiles), "
        "--diffusion-fa unless flash_attention is false",
        "cases": [],
        "skipped": [],
    }
    out = Path(args.out)

    def save() -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1) + "\n")

    tmp = Path(tempfile.mkdtemp(prefix="sizelimit-"))
    for size, fa in plan:
        left = args.deadline - (time.monotonic() - t0)
        if left < 10:
            doc["skipped"].append({"size": size, "flash_attention": fa, "why": "deadline"})
            sdcli.say(f"SKIPPED {size} fa={fa}: deadline")
            continue
        sdcli.say(f"{size}x{size} (flash attention {'on' if fa else 'off'}) ...")
        c = case(args.cli, files, size, fa, min(args.case_timeout, left - 3), tmp)
        doc["cases"].append(c)
        save()
        what = "passed" if c["passed"] else f"FAILED rc={c['returncode']} {c['signal'] or ''}"
        sdcli.say(f"  {what} in {c['wall_s']} s; phases {c['phases_s']}")
        for ln in c["cuda_error_lines"][:8]:
            print("    " + ln, flush=True)
    passed = [c["size"] for c in doc["cases"] if c["passed"] and c["flash_attention"]]
    failed = [c["size"] for c in doc["cases"] if not c["passed"] and c["flash_attention"]]
    doc["summary"] = {
        "passed": passed,
        "failed": failed,
        "largest_passed": max(passed) if passed else None,
        "smallest_failed": min(failed) if failed else None,
    }
    save()
    sdcli.say("summary:", doc["summary"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
