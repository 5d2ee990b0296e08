"""Two GPUs on one host: the figures and the device choice (also with GPU 0 held by another
process), the warning and the refusal sum, and a two-model batch on one worker per GPU
against one GPU's worker.

    python bench/two_gpu.py --model DIR --taesd-model DIR --out FILE.json [--jobs 120]

Every engine loads in a child process (the CLI or a farm worker). Holding GPU 0 needs torch.
Run by `bash bench/gpu_run.sh twogpu` on a machine with two GPUs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
GIB = 1024**3
KEPT = ("device", "warnings", "fit_plan", "timings", "exit", "stderr")


def cli(*args: str, timeout: float = 300) -> tuple[int, str, str]:
    cmd = [sys.executable, "-m", "sdfarm.cli.main", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    return done.returncode, done.stdout, done.stderr


def devices() -> dict[str, Any]:
    rc, out, err = cli("devices", "--json")
    if rc != 0:
        raise RuntimeError(f"sdfarm devices failed: {err[-1000:]}")
    return json.loads(out)


def held_gpu0(nbytes: int) -> subprocess.Popen:
    """A torch process holding `nbytes` of GPU 0 until it is killed."""
    code = (
        "import torch, time\n"
        f"t = torch.empty({nbytes}, dtype=torch.uint8, device='cuda:0')\n"
        "print('held', flush=True)\n"
        "time.sleep(900)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != "held":
        raise RuntimeError("could not hold GPU 0")
    return proc


def rules(model: Path) -> dict[str, Any]:
    """With GPU 0 nearly full: the figures and the choice, and the full model pinned to GPU 0
    (its warning names the computing GPU)."""
    before = devices()
    gpu0 = next(d for d in before["devices"] if d["name"] == "CUDA0")
    holder = held_gpu0(max(0, gpu0["free"] - 3 * GIB))
    try:
        during = devices()
        rc, out, err = cli(
            "generate", "--in-process", "--model", str(model), "--device", "CUDA0",
            "--width", "512", "--height", "512", "--steps", "1", "a red kite",
            "-o", str(Path(tempfile.mkdtemp()) / "warned.png"), "--json",
        )  # fmt: skip
        warned = json.loads(out) if rc == 0 else {"exit": rc, "stderr": err[-1500:]}
    finally:
        holder.kill()
        holder.wait()
    return {
        "devices": before,
        "devices_gpu0_held": during,
        "pinned_cuda0_while_held": {k: warned.get(k) for k in KEPT},
    }


def refusal(figures: dict[str, Any]) -> dict[str, Any]:
    """A sparse model larger than both GPUs and MemAvailable together is refused, naming each."""
    sys.path.insert(0, str(HERE.parent / "tests"))
    from helpers.badmodels import make_sparse_huge_model

    tmp = Path(tempfile.mkdtemp())
    rc, out, err = cli("make-test-model", str(tmp / "tiny"), "--json")
    tiny = Path(json.loads(out)["models"][0])
    total = sum(d["free"] for d in figures["devices"] if d["type"] == "gpu")
    apparent = int((total + figures["mem_available"]) * 1.1)
    huge = make_sparse_huge_model(tiny, tmp / "huge", apparent)
    rc, out, err = cli("generate", "--in-process", "--model", str(huge), "x", "-o", str(tmp / "x"))
    return {"apparent_bytes": apparent, "exit": rc, "message": (err or out)[-1500:]}


def farm_run(models: list[Path], devs: list[str], jobs: int, decoders: list[str]) -> dict[str, Any]:
    from sdfarm.client.farm import Farm
    from sdfarm.localfarm.farm import LocalFarm

    common = {"width": 512, "height": 512, "steps": 1}
    names = [m.name for m in models]
    with LocalFarm([models[0].parent], devs, announce=False) as local, Farm(local.url) as farm:
        warm = [
            farm.submit(n, "warm", seed=1, decoder=d, **common)
            for n, d in zip(names, decoders, strict=True)
            for _ in devs
        ]
        warm_results = [j.result(timeout=300) for j in warm]
        t0 = time.perf_counter()
        batch = [
            farm.submit(
                names[i % len(names)],
                f"job {i}",
                seed=i,
                decoder=decoders[i % len(names)],
                **common,
            )
            for i in range(jobs)
        ]
        results = [j.result(timeout=600) for j in batch]
        makespan = time.perf_counter() - t0
        placed: dict[str, dict[str, int]] = {}
        loads: dict[str, dict[str, int]] = {}
        for job, res in zip(warm + batch, warm_results + results, strict=True):
            dev, name = res.metadata["device"], res.metadata["model"]
            n_loads = sum(1 for ev in job.events() if ev.get("event") == "loading")
            loads.setdefault(dev, {}).setdefault(name, 0)
            loads[dev][name] += n_loads
            placed.setdefault(dev, {}).setdefault(name, 0)
            placed[dev][name] += 1
        gen = sum(r.metadata["timings"]["generate_s"] for r in results)
    return {
        "devices": devs,
        "jobs": jobs,
        "makespan_s": makespan,
        "images_per_s": jobs / makespan,
        "generate_sum_s": gen,
        "gpu_efficiency": gen / (len(devs) * makespan),
        "placed": placed,
        "loads": loads,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--taesd-model", required=True)
    p.add_argument("--jobs", type=int, default=120)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    model, taesd = Path(args.model).resolve(), Path(args.taesd_model).resolve()
    doc: dict[str, Any] = {"bench": "two_gpu", "date": time.strftime("%Y-%m-%d")}
    out = Path(args.out)

    def save() -> None:
        out.write_text(json.dumps(doc, indent=1, default=str) + "\n")

    doc["rules"] = rules(model)
    save()
    d, h = doc["rules"]["devices"], doc["rules"]["devices_gpu0_held"]
    print("devices:", [(x["name"], x["free"] // 2**20, x["total"] // 2**20) for x in d["devices"]])
    print("choice:", d["choice"], "| with GPU 0 held:", h["choice"])
    print("pinned CUDA0 while held:", doc["rules"]["pinned_cuda0_while_held"])
    doc["refusal"] = refusal(d)
    save()
    print("refusal:", doc["refusal"])
    # The TAESD model decodes with its TAESD: a job's decoder (sdfarm.native.decoders).
    one = farm_run([model, taesd], ["CUDA0"], args.jobs, ["default", "taesd"])
    doc["farm_one_gpu"] = one
    save()
    two = farm_run([model, taesd], ["CUDA0", "CUDA1"], args.jobs, ["default", "taesd"])
    doc["farm_two_gpus"] = two
    doc["throughput_ratio"] = two["images_per_s"] / one["images_per_s"]
    save()
    for run in (one, two):
        print(
            f"{'+'.join(run['devices'])}: {run['images_per_s']:.2f} img/s, efficiency "
            f"{run['gpu_efficiency']:.3f}, placed {run['placed']}, loads {run['loads']}"
        )
    print(f"throughput two GPUs / one GPU: {doc['throughput_ratio']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
