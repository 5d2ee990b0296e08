"""What the HTTP gateway adds over the Python client, on the same tiny-model jobs.

A local farm (private redis-server, scheduler, one CPU worker) and `sdfarm gateway` in its
own process; jobs alternate between `Farm.submit(...).result()` and the real `openai`
package's `images.generate(response_format="b64_json")` through the gateway, one at a time,
so both see the same farm state. Prints p50/p99 latency of each and their difference.

    python bench/gateway_overhead.py [--jobs 60] [--size 64] [--steps 1] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not answer in {timeout} s")
        time.sleep(0.1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=60)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import openai

    from sdfarm.client.farm import Farm
    from sdfarm.localfarm.farm import LocalFarm
    from sdfarm.native.testmodel import make_test_model

    size = f"{args.size}x{args.size}"
    with tempfile.TemporaryDirectory() as tmp:
        tiny = make_test_model(Path(tmp))[1]
        with LocalFarm([tiny.parent], announce=False) as local, Farm(local.url) as farm:
            port = free_port()
            gw = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "sdfarm.cli.main",
                    "gateway",
                    "--port",
                    str(port),
                    "--redis",
                    local.url,
                    "--log-level",
                    "warning",
                ],
                env=dict(os.environ),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            try:
                wait_http(f"http://127.0.0.1:{port}/healthz")
                oa = openai.OpenAI(
                    base_url=f"http://127.0.0.1:{port}/v1",
                    api_key="none",
                    max_retries=0,
                    timeout=120,
                )
                common = {"width": args.size, "height": args.size, "steps": args.steps}
                farm.submit(tiny.name, "warm", seed=0, **common).result(timeout=300)
                oa.images.generate(
                    model=tiny.name,
                    prompt="warm",
                    size=size,
                    response_format="b64_json",
                    extra_body={"steps": args.steps, "seed": 0},
                )
                client_lat, gateway_lat = [], []
                for i in range(args.jobs):
                    t = time.perf_counter()
                    farm.submit(tiny.name, f"prompt {i}", seed=i, **common).result(timeout=120)
                    client_lat.append(time.perf_counter() - t)
                    t = time.perf_counter()
                    oa.images.generate(
                        model=tiny.name,
                        prompt=f"prompt {i}",
                        size=size,
                        response_format="b64_json",
                        extra_body={"steps": args.steps, "seed": i},
                    )
                    gateway_lat.append(time.perf_counter() - t)
            finally:
                gw.terminate()
                gw.wait(10)
    rows = {
        "client": {"p50_ms": pct(client_lat, 50) * 1e3, "p99_ms": pct(client_lat, 99) * 1e3},
        "gateway": {"p50_ms": pct(gateway_lat, 50) * 1e3, "p99_ms": pct(gateway_lat, 99) * 1e3},
    }
    added = [g - c for g, c in zip(gateway_lat, client_lat, strict=True)]
    print(f"{args.jobs} jobs each way, tiny model, {size}, {args.steps} step(s)")
    print(f"{'':22} {'python client':>14} {'gateway':>10}")
    for k in ("p50_ms", "p99_ms"):
        print(f"latency {k:14} {rows['client'][k]:>14.2f} {rows['gateway'][k]:>10.2f}")
    print(
        f"gateway added (paired, per job): p50 {pct(added, 50) * 1e3:.2f} ms, "
        f"p99 {pct(added, 99) * 1e3:.2f} ms"
    )
    if args.out:
        doc = {
            "bench": "gateway_overhead",
            "jobs": args.jobs,
            "size": size,
            "steps": args.steps,
            "machine": platform.platform(),
            "date": time.strftime("%Y-%m-%d"),
            **rows,
            "added_p50_ms": pct(added, 50) * 1e3,
            "added_p99_ms": pct(added, 99) * 1e3,
        }
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
