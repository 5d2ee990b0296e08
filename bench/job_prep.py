"""The worker's per-job preparation on a warm engine, without the native call: the catalog's
model, the job's checked parameters, its decoder, the model's facts and the job's estimate,
as `_prepare_generate` does them for every job (sdfarm.worker.tasks). Measured on a sparse
file with the full-size SD-Turbo model's header (1,228 tensors, 176 KB of JSON, no data read),
so it runs anywhere in a second.

    python bench/job_prep.py [--jobs 200] [--out FILE.json]

Found by the H200's 500-job efficiency run (docs/gpu.md): the time from a job's claim to its
native call had grown from 0.9 ms to 5.2 ms, because the model's architecture, decoders and
video reading were each a scan of every tensor name, redone for every job.
"""

from __future__ import annotations

import argparse
import json
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

from fullsize_model import numel, tensor_list

from sdfarm.native.catalog import Catalog
from sdfarm.native.decoders import resolve as resolve_decoder
from sdfarm.native.devices import Device
from sdfarm.native.estimate import model_facts
from sdfarm.native.params import from_mapping, validate

H200 = Device(index=0, name="CUDA0", description="NVIDIA H200", type="gpu",
              free=142_629 << 20, total=143_771 << 20)  # fmt: skip


def sparse_model(folder: Path) -> int:
    """A model.safetensors with the full-size header and a hole for its data; its tensors."""
    header, offset = {}, 0
    for name, shape in tensor_list("sd-turbo"):
        n = numel(shape) * 2
        header[name] = {"dtype": "F16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    folder.mkdir(parents=True)
    with open(folder / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        f.truncate(8 + len(blob) + offset)
    return len(header)


def prepare(catalog: Catalog, name: str) -> int:
    """One job's preparation, as the worker does it: its estimate in bytes."""
    params = validate(from_mapping(
        {"prompt": "a lighthouse", "width": 512, "height": 512, "steps": 1, "cfg_scale": 1.0}
    ))  # fmt: skip
    model = catalog.load(name)
    decoder = resolve_decoder(params.decoder, model.decoders, model.name)
    facts = model_facts(model, H200, decoder)
    return facts.estimate(*params.final_size, params.encodes, 0, tiled=False)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=200)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tensors = sparse_model(Path(tmp) / "sd-turbo-header")
        catalog = Catalog([tmp])
        prepare(catalog, "sd-turbo-header")  # the catalog's first read, as a worker's first job
        times = []
        for _ in range(args.jobs):
            t = time.perf_counter()
            prepare(catalog, "sd-turbo-header")
            times.append(time.perf_counter() - t)
    doc = {
        "bench": "job_prep",
        "tensors": tensors,
        "jobs": args.jobs,
        "median_ms": round(statistics.median(times) * 1e3, 3),
        "p90_ms": round(sorted(times)[int(0.9 * (len(times) - 1))] * 1e3, 3),
    }
    print(
        f"per-job preparation, full-size header ({tensors} tensors): median "
        f"{doc['median_ms']} ms, p90 {doc['p90_ms']} ms over {args.jobs} jobs"
    )
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
