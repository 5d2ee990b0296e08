"""Whether NVIDIA's Multi-Process Service (MPS) serves this host's CUDA processes.

Without MPS, CUDA time-slices the contexts of different processes: two engine slots on one
GPU overlap only each other's host-side gaps, and four gain nothing over two. Under MPS every
engine process becomes a client of one server context, so kernels of different engines run
at once on the GPU. Measured on the H200 (docs/gpu.md, `bash bench/gpu_run.sh peertwo`,
SD-Turbo architecture, 512x512, 1 step): 9.71 images/s with two engines without MPS against
10.92 with MPS, 12.37 with four and 12.71 with eight.

The CUDA driver looks for the control daemon's pipes in `CUDA_MPS_PIPE_DIRECTORY` (default
/tmp/nvidia-mps) when a process first initialises CUDA, and runs the process as an MPS client
when it finds them; so does this probe, without touching CUDA. Every OS access is a
parameter, so the rule is tested with fakes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path

PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"
CONTROL_PIPE = "control"
"""The control daemon's named pipe in the pipe directory, there while the daemon runs."""


def pipe_directory(env: Mapping[str, str] | None = None) -> Path:
    """The directory the CUDA driver looks in for the MPS control daemon's pipes."""
    env = os.environ if env is None else env
    return Path(env.get(PIPE_ENV) or DEFAULT_PIPE_DIRECTORY)


def mps_active(
    env: Mapping[str, str] | None = None,
    exists: Callable[[Path], bool] = os.path.exists,
) -> bool:
    """Whether a CUDA process started now would be an MPS client: the control daemon's pipe
    is in the pipe directory this process's environment names."""
    return bool(exists(pipe_directory(env) / CONTROL_PIPE))
