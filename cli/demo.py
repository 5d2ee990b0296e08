"""`./dev demo`: the quick start's main job, end to end on this machine.

Makes the tiny test model in ./models (once), starts a local farm (private redis-server,
scheduler, a worker per device), renders examples/prompts.txt into ./out through
`sdfarm batch`, prints the summary and stops the farm. Finished images are skipped, so a
re-run (or a run after Ctrl-C) only does what is missing, and starts no farm when nothing is.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PROMPTS = ROOT / "examples" / "prompts.txt"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="./dev demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", default=str(DEFAULT_PROMPTS))
    p.add_argument("--models", default="models", help="where the tiny model is made")
    p.add_argument("--out", default="out")
    p.add_argument("--model", default="tiny-q8_0")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--height", type=int, default=64)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--json", action="store_true", help="the summary as one JSON document")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from sdfarm.cli import main as cli
    from sdfarm.client.batch_input import read_items
    from sdfarm.client.batch_output import existing_files, split_done

    models = Path(args.models).resolve()
    if not (models / args.model / "model.json").is_file():
        from sdfarm.native.testmodel import make_test_model

        print(f"making the tiny test model in {models}", file=sys.stderr)
        make_test_model(models)
    batch = [
        "batch", args.prompts, "--out", args.out, "--model", args.model,
        "--width", str(args.width), "--height", str(args.height),
        "--steps", str(args.steps), "--seed", str(args.seed),
    ]  # fmt: skip
    if args.json:
        batch.append("--json")
    todo, _ = split_done(read_items(args.prompts), existing_files(Path(args.out)))
    if not todo:
        return cli.main(batch)  # everything is there: the summary says so, no farm needed

    from sdfarm.localfarm.farm import LocalFarm

    t0 = time.monotonic()
    print("starting a local farm (redis-server, scheduler, workers)", file=sys.stderr)
    with LocalFarm([models], announce=False) as farm:
        print(
            f"farm up in {time.monotonic() - t0:.1f} s: {farm.url}, devices "
            f"{', '.join(farm.devices)}",
            file=sys.stderr,
        )
        code = cli.main([*batch, "--redis", farm.url])
    print(f"farm stopped; images in {Path(args.out).resolve()}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
