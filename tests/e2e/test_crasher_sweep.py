"""The crasher sweep (bench/crasher_sweep.py) on the real runtime with the tiny model: with
validation, every sampler x scheduler x steps combination of the grid is either refused or
generates; nothing kills its process. The grid is every sampler and scheduler (each with
"default") at 1 and 2 steps, 64x64, plus the long prompt that the old limit let through:
the sweep without validation found every crasher at 1 step (docs/crashers.md), and 2 steps
is where the refused schedulers start to generate. 63-75 s on 2 cores (2 children)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from sdfarm.native.params import MIN_STEPS

pytestmark = pytest.mark.e2e

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "crasher_sweep.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("crasher_sweep", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


cs = _load_script()


def test_with_validation_every_combination_is_refused_or_generates(tiny_models, capsys):
    combos = cs.grid(steps=(1, 2), sizes=((64, 64),), prompts=("short", "cjk-9000"))
    assert len(combos) == len(cs.ALL_SAMPLERS) * len(cs.ALL_SCHEDULERS) * 2 + 1
    result = cs.sweep(combos, tiny_models[0], validate=True, jobs=min(2, os.cpu_count() or 1))
    with capsys.disabled():
        print(f"\ncrasher sweep with validation ({len(combos)} combinations)")
        print(result.table())

    counts = result.counts()
    problems = [o.as_dict() for o in result.outcomes if o.status not in ("refused", "generated")]
    assert counts["crashed"] == 0 and counts["hang"] == 0, problems
    assert not problems, problems
    assert counts["refused"] + counts["generated"] == counts["tried"] == len(combos)

    # Refused are exactly the combinations a rule names, each error naming its parameter and
    # why; their neighbours (2 steps, the short prompt) generate.
    for o in result.outcomes:
        c = o.combo
        expected = c.prompt != "short" or c.steps < MIN_STEPS.get(c.scheduler, (1, ""))[0]
        assert (o.status == "refused") == expected, o.as_dict()
        if o.status == "refused" and c.prompt == "short":
            assert o.message.startswith("invalid steps: scheduler ") and "at least 2" in o.message
        elif o.status == "refused":
            assert o.message.startswith("invalid prompt: ") and "tokens" in o.message
    generated_at_2 = {
        o.combo.scheduler for o in result.outcomes if o.combo.steps == 2 and not o.blank
    }
    assert set(MIN_STEPS) <= generated_at_2
    assert result.children == min(2, os.cpu_count() or 1)  # no child died


def test_without_validation_the_sweep_records_the_crash_and_goes_on(tiny_models):
    """The harness itself: the known crasher kills its child, is recorded with the signal,
    and the next combination runs in a new child."""
    combos = cs.grid(("euler",), ("gits",), (1, 2), ((64, 64),))
    result = cs.sweep(combos, tiny_models[0], validate=False)
    crashed, generated = result.outcomes
    assert crashed.status == "crashed" and crashed.signal == "SIGSEGV", crashed.as_dict()
    assert crashed.combo.steps == 1
    assert generated.status == "generated" and not generated.blank
    assert result.children == 2
    assert "| euler | gits | 1 | 64x64 | short | SIGSEGV |" in result.crasher_table()
