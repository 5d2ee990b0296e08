"""The MPS probe: the control daemon's pipe in the directory the environment names."""

from __future__ import annotations

from pathlib import Path

import pytest

from sdfarm.native.mps import mps_active, pipe_directory


@pytest.mark.parametrize(
    ("env", "present", "want"),
    [
        ({}, {"/tmp/nvidia-mps/control"}, True),
        ({}, set(), False),
        ({}, {"/tmp/nvidia-mps/log"}, False),
        ({"CUDA_MPS_PIPE_DIRECTORY": "/run/mps"}, {"/run/mps/control"}, True),
        ({"CUDA_MPS_PIPE_DIRECTORY": "/run/mps"}, {"/tmp/nvidia-mps/control"}, False),
        ({"CUDA_MPS_PIPE_DIRECTORY": ""}, {"/tmp/nvidia-mps/control"}, True),
    ],
)
def test_mps_active_follows_the_pipe_directory(
    env: dict[str, str], present: set[str], want: bool
) -> None:
    assert mps_active(env, exists=lambda p: str(p) in present) is want


def test_a_real_directory_with_a_control_pipe(tmp_path: Path) -> None:
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}
    assert pipe_directory(env) == tmp_path and not mps_active(env)
    (tmp_path / "control").touch()
    assert mps_active(env)
