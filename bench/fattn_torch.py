"""PyTorch's scaled-dot-product attention at the shapes of bench/fattn_bench.cpp.

What diffusers runs for an SD 2.x UNet's attention (f16 Q, K, V of head size 64; the
cross-attention over the prompt's 77 tokens, unpadded), timed with CUDA events, so that
ggml's flash-attention kernel can be put beside the attention the peer benchmark's
PyTorch uses. Prints one JSON line per case and the sum per UNet call at 512 and 1024.

    python bench/fattn_torch.py [reps]
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F

# (name, query tokens, key tokens, heads, calls per UNet at 512, calls per UNet at 1024)
CASES = [
    ("self 16384 x 5 heads", 16384, 16384, 5, 0, 5),
    ("self 4096 x 10 heads", 4096, 4096, 10, 0, 5),
    ("self 1024 x 20 heads", 1024, 1024, 20, 0, 5),
    ("self 256 x 20 heads", 256, 256, 20, 5, 1),
    ("self 4096 x 5 heads", 4096, 4096, 5, 5, 0),
    ("self 1024 x 10 heads", 1024, 1024, 10, 5, 0),
    ("self 64 x 20 heads", 64, 64, 20, 1, 0),
    ("cross 16384 x 5 heads", 16384, 77, 5, 0, 5),
    ("cross 4096 x 10 heads", 4096, 77, 10, 0, 5),
    ("cross 1024 x 20 heads", 1024, 77, 20, 0, 5),
    ("cross 256 x 20 heads", 256, 77, 20, 5, 1),
    ("cross 4096 x 5 heads", 4096, 77, 5, 5, 0),
    ("cross 1024 x 10 heads", 1024, 77, 10, 5, 0),
    ("cross 64 x 20 heads", 64, 77, 20, 1, 0),
]


def time_case(lq: int, lk: int, heads: int, reps: int) -> tuple[float, float]:
    """Median and minimum ms of one SDPA call, f16, batch 1, head size 64."""
    gen = torch.Generator(device="cuda").manual_seed(1234)
    q = torch.rand(1, heads, lq, 64, device="cuda", dtype=torch.float16, generator=gen) * 2 - 1
    k = torch.rand(1, heads, lk, 64, device="cuda", dtype=torch.float16, generator=gen) * 2 - 1
    v = torch.rand(1, heads, lk, 64, device="cuda", dtype=torch.float16, generator=gen) * 2 - 1
    for _ in range(3):
        F.scaled_dot_product_attention(q, k, v)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        F.scaled_dot_product_attention(q, k, v)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2], times[0]


def main() -> None:
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    totals = [0.0, 0.0]
    for name, lq, lk, heads, n512, n1024 in CASES:
        med, low = time_case(lq, lk, heads, reps)
        flop = 4.0 * lq * lk * 64 * heads
        print(
            json.dumps(
                {
                    "case": name,
                    "lq": lq,
                    "lk": lk,
                    "heads": heads,
                    "ms": round(med, 4),
                    "min_ms": round(low, 4),
                    "tflops": round(flop / med / 1e9, 1),
                    "per_unet_512": n512,
                    "per_unet_1024": n1024,
                }
            ),
            flush=True,
        )
        totals[0] += med * n512
        totals[1] += med * n1024
    print(
        json.dumps(
            {
                "case": "per UNet call",
                "ms_512": round(totals[0], 3),
                "ms_1024": round(totals[1], 3),
                "torch": torch.__version__,
            }
        )
    )


if __name__ == "__main__":
    main()
