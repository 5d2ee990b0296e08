"""bench/cudnn_check.cpp's convolutions through cuDNN, run inside a Python process, after a
CUDA engine of ours has generated an image when ENGINE=1: the two differences left between
the bare process where cuDNN runs and the engine's process where it crashed (docs/gpu.md,
"Convolutions through cuDNN"). The engine uses im2col (SDFARM_CUDNN unset), so only its
CUDA backend's state is beside cuDNN, not our patch's calls.

    g++ -O1 -shared -fPIC -DCUDNN_CHECK_LIBRARY -I/usr/local/cuda/include bench/cudnn_check.cpp \\
        -o /tmp/cudnn_check.so -L/usr/local/cuda/lib64 -lcudart -ldl
    [ENGINE=1 DEVICE=CUDA0] python bench/cudnn_check_in_python.py /tmp/cudnn_check.so LIBCUDNN

STDCXX_GLOBAL=1 opens libstdc++ with RTLD_GLOBAL first (as a C++ program has it); MAPS=FILE
writes the libraries mapped just before cuDNN runs, one a line, to FILE.
"""

from __future__ import annotations

import ctypes
import os
import sys
import tempfile
from pathlib import Path


def engine_image(device: str) -> None:
    """One 64x64 image of the tiny test model through our engine on `device`, the engine kept
    alive (its backend's context, streams and pools stay), so cuDNN runs beside it."""
    from sdfarm.native.engine import Engine, LogConfig
    from sdfarm.native.params import GenerationParams
    from sdfarm.native.testmodel import make_test_model

    folder = Path(tempfile.mkdtemp(prefix="cudnn-check-"))
    make_test_model(folder)
    engine = Engine.load(folder / "tiny-f16", log=LogConfig(level="warn"), device=device)
    engine.generate(GenerationParams(prompt="a cat", width=64, height=64, steps=1, seed=1))
    print(f"engine on {device}: one image", flush=True)
    globals()["_engine"] = engine  # kept for the check


def mapped_libraries() -> list[str]:
    """The shared libraries this process has mapped, in the order they first appear."""
    seen: dict[str, None] = {}
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line[line.find("/") :] if "/" in line else ""
        if ".so" in path:
            seen.setdefault(path, None)
    return list(seen)


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    check, libcudnn = sys.argv[1], sys.argv[2]
    if os.environ.get("ENGINE") == "1":
        engine_image(os.environ.get("DEVICE", "CUDA0"))
    if os.environ.get("STDCXX_GLOBAL") == "1":
        ctypes.CDLL("libstdc++.so.6", mode=os.RTLD_GLOBAL)
        print("libstdc++.so.6 opened RTLD_GLOBAL", flush=True)
    lib = ctypes.CDLL(check)
    if os.environ.get("MAPS"):
        Path(os.environ["MAPS"]).write_text("\n".join(mapped_libraries()) + "\n")
    argv = (ctypes.c_char_p * 2)(b"cudnn_check", libcudnn.encode())
    rc = lib.cudnn_check_main(2, argv)
    print(f"cudnn_check_main returned {rc}", flush=True)
    return int(rc)


if __name__ == "__main__":
    raise SystemExit(main())
