"""The engine's import chain stays free of numpy: on the H200 host's Python (numpy 2.5.2 with
scipy-openblas64) numpy imported before `new_sd_ctx` makes the runtime's load segfault
(docs/gpu.md). A helper module that imported numpy at the top once took every CUDA worker
down there; this keeps the chain honest in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys

import pytest

LOADERS = [
    "sdfarm.native.engine",
    "sdfarm.worker.tasks",
    "sdfarm.worker.main",
    "sdfarm.cli.inprocess",
]


@pytest.mark.parametrize("module", LOADERS)
def test_importing_a_loader_leaves_numpy_unimported(module: str) -> None:
    code = (
        f"import sys, importlib; importlib.import_module({module!r}); "
        "print(sorted(m for m in sys.modules if m == 'numpy' or m.startswith('numpy.'))[:3])"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]", f"{module} imports numpy: {run.stdout.strip()}"
