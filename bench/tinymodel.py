"""The tiny test model for the benchmarks that default to it (`python bench/X.py` puts this
folder on sys.path, so they import it as `tinymodel`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def tiny_model(folder: str | Path) -> Path:
    """The tiny test model (tiny-f16), written into `folder` by a child process: numpy stays
    out of the caller (on the H200 host, numpy imported before a runtime load crashed it:
    docs/gpu.md)."""
    cmd = [sys.executable, "-m", "sdfarm.cli.main", "make-test-model", str(folder), "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return Path(json.loads(done.stdout)["models"][0])
