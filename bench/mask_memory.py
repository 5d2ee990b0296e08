"""The UNet's compute buffer at sizes whose latent token count is, and is not, a multiple of
256: where it is not, the runtime pads the self-attention's keys with a mask of
pad256(tokens) x tokens values (native/backendlimits.py), which the estimate counts
(sdfarm.native.estimate.MASK_BYTES_PER_VALUE). The runtime's own log gives the buffer sizes.

    python bench/mask_memory.py [--sizes 512,576,640] [--out FILE]

The SD 1.x test model (sdfarm.native.sd1model) on the CPU, 1 step per size.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="512,576,640")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from sdfarm.native.backendlimits import attention_rows, self_attention_mask_values
    from sdfarm.native.engine import Engine, LogConfig
    from sdfarm.native.params import GenerationParams
    from sdfarm.native.sd1model import ensure_sd1_test_model

    engine = Engine.load(ensure_sd1_test_model() / "sd1-tiny", threads=2,
                         log=LogConfig(level="debug"))  # fmt: skip
    rows = []
    for size in [int(s) for s in args.sizes.split(",")]:
        t = time.perf_counter()
        result = engine.generate(
            GenerationParams(prompt="x", seed=1, width=size, height=size, steps=1)
        )
        found = {}
        for record in result.records:
            m = re.search(r"(\w+) compute buffer size: ([\d.]+) MB", record.message)
            if m:
                found[m.group(1)] = max(found.get(m.group(1), 0.0), float(m.group(2)))
        row = {"size": size, "tokens": attention_rows(size, size),
               "mask_values": self_attention_mask_values(size, size),
               "unet_buffer_mb": found.get("unet"), "buffers_mb": found,
               "seconds": round(time.perf_counter() - t, 1)}  # fmt: skip
        rows.append(row)
        print(f"{size:>5} tokens {row['tokens']:>6}  mask {row['mask_values']:>12,} values  "
              f"UNet buffer {row['unet_buffer_mb']} MB", flush=True)  # fmt: skip
    engine.dispose()
    if args.out:
        Path(args.out).write_text(
            json.dumps({"bench": "mask_memory", "rows": rows}, indent=2) + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
