"""What the image-to-video Wan test model (`wan-i2v-test`, sdfarm.native.wantestmodel) costs to
write: each file's bytes and seconds, in a fresh temporary folder. A cold CI run writes it;
beside `wan-t2v-test` in the cache the VAE is hard-linked, so the DiT and the CLIP vision
encoder are what it adds.

    python bench/wan_i2v_testmodel.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def main() -> int:
    from sdfarm.native.wantestmodel import (
        I2V_1_3B,
        I2V_DIT_FILE,
        VAE_FILE,
        VISION_FILE,
        write_dit,
        write_vae,
        write_vision,
    )

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, write in (
            (I2V_DIT_FILE, lambda p: write_dit(p, I2V_1_3B)),
            (VISION_FILE, write_vision),
            (VAE_FILE, write_vae),
        ):
            path = Path(tmp) / name
            t = time.monotonic()
            write(path)
            seconds = time.monotonic() - t
            rows.append({"file": name, "bytes": path.stat().st_size, "write_s": round(seconds, 2)})
            print(f"{name:>18}  {path.stat().st_size:>13,} bytes  {seconds:6.2f} s", flush=True)
    added = [r for r in rows if r["file"] != VAE_FILE]
    total = (sum(r["bytes"] for r in added), round(sum(r["write_s"] for r in added), 2))
    print(f"{'beside wan-t2v-test':>18}  {total[0]:>13,} bytes  {total[1]:6.2f} s (VAE linked)")
    if args.out:
        doc = {"what": "wan-i2v-test's files written one by one", "rows": rows}
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
