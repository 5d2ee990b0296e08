"""The pinned runtime source for the tests of our patches (native/patches/*.cuh): the source
itself, a CUDA-patched copy, and our fusions' graph walks asked on a graph the pinned ggml
builds on the host (a C++ harness compiled against the pinned headers and linked to the CPU
runtime's library, which holds that ggml)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from sdfarm.native import build, sourcepatch


def pinned_source() -> Path:
    """The unpacked pinned stable-diffusion.cpp (the build's cache; never to be modified)."""
    root = build.cache_root()
    return build.unpack_sdist(build.fetch_sdist(root), root)


def cuda_patched_source(tmp_path: Path) -> Path:
    """A copy of the pinned source with every CUDA patch applied, under tmp_path."""
    return sourcepatch.apply(pinned_source(), tmp_path / "patched", sourcepatch.for_backend("cuda"))


def run_graph_harness(tmp_path: Path, source: str) -> list[str]:
    """Compile `source` (it includes a patch header with SDFARM_HOST_GRAPH or
    SDFARM_GN_HOST_GRAPH defined), run it, and return its stdout's lines; a failed run
    fails the test with its output."""
    runtime = build.ensure_runtime("cpu")
    src = pinned_source()
    cxx = shutil.which("g++") or shutil.which("c++")
    assert cxx, "a C++ compiler is needed (the runtime's build needs one too)"
    (tmp_path / "graph.cpp").write_text(source)
    lib = Path(runtime.library)
    exe = tmp_path / "graph"
    subprocess.run(
        [cxx, "-std=c++17", "-O1", f"-I{src / 'ggml/include'}", f"-I{src / 'ggml/src'}",
         f"-I{sourcepatch.HERE}", str(tmp_path / "graph.cpp"), "-o", str(exe), str(lib),
         f"-Wl,-rpath,{lib.parent}"],
        check=True,
    )  # fmt: skip
    done = subprocess.run([str(exe)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.splitlines()
