"""Variants of ggml's CUDA flash-attention configuration for head size 64, built side by side.

ggml's MMA flash-attention kernel takes its block shape from a table
(`ggml_cuda_fattn_mma_get_config_ampere`, used from Ampere on, Hopper included): for head
size 64 and 64 query columns a block has 128 threads, 2 blocks an SM, and rescales its
softmax every 64 keys. Those were tuned for language models; an SD UNet asks 16,384 queries
against 16,384 keys. This script makes that one row read macros (ggml's values as defaults),
then, in a configured ggml build tree, compiles the one translation unit that holds the
64-column kernels once per variant and relinks libggml-cuda.so beside the build, so that
bench/fattn_bench.cpp can time each variant in its own process (LD_LIBRARY_PATH) without a
rebuild of the whole library per variant.

    python bench/fattn_variants.py patch GGML_DIR
    python bench/fattn_variants.py build BUILD_DIR NAME=THREADS,OCCUPANCY,NBATCH_FA,STAGES ...
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROW = "GGML_CUDA_FATTN_MMA_CONFIG_CASE( 64,  64, 64, 128, 2,  64,  32,  32,  32, 2, true);"
MACRO_ROW = (
    "GGML_CUDA_FATTN_MMA_CONFIG_CASE( 64,  64, 64, SDFARM_FA64_NT, SDFARM_FA64_OCC, "
    "SDFARM_FA64_NBFA,  32,  32,  32, SDFARM_FA64_NST, true);"
)
DEFAULTS = {
    "SDFARM_FA64_NT": 128,
    "SDFARM_FA64_OCC": 2,
    "SDFARM_FA64_NBFA": 64,
    "SDFARM_FA64_NST": 2,
}
ANCHOR = (
    "static constexpr __host__ __device__ fattn_mma_config ggml_cuda_fattn_mma_get_config_ampere("
)
INSTANCE = "fattn-mma-f16-instance-ncols1_64-ncols2_1.cu"


def patch(ggml_dir: Path) -> None:
    """Make the head-size-64, 64-column row of the table read SDFARM_FA64_* macros."""
    header = ggml_dir / "src" / "ggml-cuda" / "fattn-mma-f16.cuh"
    text = header.read_text()
    if MACRO_ROW in text:
        return
    if text.count(ROW) != 1 or text.count(ANCHOR) != 1:
        raise SystemExit(f"{header}: the row or the table this script knows is not there")
    defaults = "".join(f"#ifndef {k}\n#define {k} {v}\n#endif\n" for k, v in DEFAULTS.items())
    text = text.replace(ROW, MACRO_ROW).replace(ANCHOR, defaults + ANCHOR)
    header.write_text(text)


def _instance_command(build: Path) -> dict:
    for entry in json.loads((build / "compile_commands.json").read_text()):
        if entry["file"].endswith(INSTANCE):
            return entry
    raise SystemExit(f"{INSTANCE} is not in {build}/compile_commands.json")


def _link_command(build: Path) -> tuple[Path, list[str]]:
    link = next(build.rglob("ggml-cuda.dir/link.txt"))
    return link.parent.parent.parent, shlex.split(link.read_text())


def _swap(args: list[str], obj: str, new_obj: str, cwd: Path, out: Path) -> list[str]:
    """The link arguments with the object `obj` replaced by `new_obj`, also inside CMake's
    response files (`@objects1.rsp`: a long object list is passed that way)."""
    swapped = []
    for a in args:
        if a.startswith("@"):
            rsp = cwd / a[1:]
            text = rsp.read_text()
            if obj in text:
                mine = out / rsp.name
                mine.write_text(text.replace(obj, new_obj))
                a = "@" + str(mine)
        elif a == obj or a.endswith("/" + obj):
            a = new_obj
        swapped.append(a)
    if swapped == args:
        raise SystemExit(f"{obj} is not in the link command: the variant would be ggml's own")
    return swapped


def build_variant(build: Path, name: str, values: list[int]) -> Path:
    """Compile the 64-column instance with VALUES and link a libggml-cuda.so of its own."""
    out = build / "fa-variants" / name
    out.mkdir(parents=True, exist_ok=True)
    entry = _instance_command(build)
    args = shlex.split(entry["command"]) if "command" in entry else list(entry["arguments"])
    obj_index = args.index("-o") + 1
    obj = args[obj_index]
    args[obj_index] = str(out / "instance.o")
    args[1:1] = [f"-D{k}={v}" for k, v in zip(DEFAULTS, values, strict=True)]
    subprocess.run(args, cwd=entry["directory"], check=True)
    cwd, link = _link_command(build)
    obj_rel = str(Path(obj).relative_to(cwd)) if Path(obj).is_absolute() else obj
    link = _swap(link, obj_rel, str(out / "instance.o"), cwd, out)
    target = link[link.index("-o") + 1]
    link[link.index("-o") + 1] = str(out / Path(target).name)
    subprocess.run(link, cwd=cwd, check=True)
    for extra in Path(cwd, target).parent.glob("libggml-cuda.so*"):  # the soname links
        dst = out / extra.name
        if not dst.exists():
            dst.symlink_to(out / Path(target).name)
    return out


def main(argv: list[str]) -> None:
    if argv[:1] == ["patch"] and len(argv) == 2:
        patch(Path(argv[1]))
        return
    if argv[:1] == ["build"] and len(argv) >= 3:
        build = Path(argv[1])
        specs = {}
        for spec in argv[2:]:
            name, _, values = spec.partition("=")
            specs[name] = [int(v) for v in values.split(",")]
        with ThreadPoolExecutor(len(specs)) as pool:
            futures = {n: pool.submit(build_variant, build, n, v) for n, v in specs.items()}
            for name, fut in futures.items():
                try:
                    print(f"{name} {fut.result()}", flush=True)
                except Exception as exc:  # one variant that does not compile leaves the rest
                    print(f"{name} FAILED {exc}", file=sys.stderr, flush=True)
        return
    raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
