"""Whether the runtime's smaller SD 1.x variant, the tiny UNet (BK-SDM-Tiny, which master-596
detects as "SD 1.x Tiny UNet"), takes the SD 1.x ControlNet: the answer that made the
ControlNet test model the full SD 1.x UNet, and made sdfarm refuse a ControlNet for a UNet
without a middle attention block (sdfarm.native.controlnets.unet_refusal).

Writes a random-weight tiny UNet checkpoint (q4_0 like the test model, its CLIP-L and TAESD)
and generates 64x64 with it in a child process, alone and with the test model's ControlNet
(sdfarm's own refusal bypassed, to see what the runtime does); prints each child's outcome.

    python bench/controlnet_tiny_unet.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import io, sys
from pathlib import Path
import numpy as np
from PIL import Image
from sdfarm.native import engine as E
from sdfarm.native.controlnets import ControlNetCatalog, controlnet_dirs
from sdfarm.native.engine import Engine, LogConfig
from sdfarm.native.params import GenerationParams

folder, models, with_cn = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "cn"
E.check_extras = lambda *a: None  # bypass sdfarm's refusal: what does the runtime do?
cn = ControlNetCatalog(controlnet_dirs([models])).load("sd1-control") if with_cn else None
engine = Engine.load(folder, threads=2, check_memory=False, control_net=cn,
                     log=LogConfig(level="info"))
print([r.message for r in engine.drain_load_records() if "Version" in r.message][0], flush=True)
buf = io.BytesIO()
Image.fromarray(np.zeros((64, 64, 3), np.uint8)).save(buf, "PNG")
extra = {"control_net": "sd1-control", "control_image": buf.getvalue()} if with_cn else {}
r = engine.generate(GenerationParams(prompt="x", width=64, height=64, steps=1, seed=1, **extra))
print("generated", r.image.size, flush=True)
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    from sdfarm.native import sd1model
    from sdfarm.native.sd1model import ensure_sd1_test_model

    models = ensure_sd1_test_model()
    rows = []
    with tempfile.TemporaryDirectory(prefix="sdfarm-tiny-unet-") as tmp:
        folder = Path(tmp) / "sd1-tiny-unet"
        specs = sd1model.tiny_unet_specs() + sd1model.clip_l_specs()
        sd1model.write_gguf(folder / "sd1.gguf", specs, "sdfarm-sd1-tiny-unet")
        (folder / "taesd.safetensors").symlink_to(models / "sd1-tiny" / "taesd.safetensors")
        manifest = {"files": {"checkpoint": "sd1.gguf", "taesd": "taesd.safetensors"}}
        (folder / "model.json").write_text(json.dumps(manifest))
        for case in ("alone", "cn"):
            done = subprocess.run([sys.executable, "-c", CHILD, str(folder), str(models), case],
                                  capture_output=True, text=True, timeout=600)  # fmt: skip
            lines = (done.stdout + done.stderr).splitlines()
            said = [ln for ln in lines if "Version" in ln or "generated" in ln or "GGML_" in ln]
            row = {"case": "with the SD 1.x ControlNet" if case == "cn" else "alone",
                   "returncode": done.returncode, "said": [s[-160:] for s in said]}  # fmt: skip
            rows.append(row)
            print(f"{row['case']:28} rc={row['returncode']:4}  " + " | ".join(row["said"]))
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows}, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
