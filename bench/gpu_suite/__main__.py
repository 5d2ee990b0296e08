"""`python bench/gpu_suite ARGS` (and `python bench/gpu_suite _child SPEC`, how the suite runs
each measurement): the folder above this package goes on sys.path, in place of the package's
own folder, so the modules import as `gpu_suite.*` and none of them shadows another module."""

from __future__ import annotations

import os
import sys

if not __package__:  # run as a folder, not as `python -m gpu_suite`
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
    sys.path.insert(0, os.path.dirname(_here))

from gpu_suite.cli import main  # noqa: E402 - needs the sys.path above

if __name__ == "__main__":
    sys.exit(main())
