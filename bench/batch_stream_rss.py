"""The batch client's memory while it streams a 100,000-line JSONL file into a farm: flat.

`sdfarm batch` checks the file in one streaming pass (`scan_items`, 8 bytes per item), then
streams it again into the farm (`iter_items` -> `run_batch`), one item ahead of its window of
jobs in flight: the client holds the window, not the file. This runs exactly that path (the
real `Farm` client, a real redis-server, every PNG and sidecar written to disk) and samples
the client's RSS every 0.1 s, printing it at the start, after the scan, and at every tenth of
the batch.

The farm's side is played by a second process on the same Redis, through the Store's real
transitions (place, claim, finish with a 64x64 PNG), so jobs are cheap and the client is what
is measured; finished keys live SDFARM_RESULT_TTL = 120 s there, so Redis does not hold all
100,000 results. For contrast, a third process reads the same file whole (`read_items`, the
old path) and reports what that list costs.

    python bench/batch_stream_rss.py [--lines 100000] [--in-flight 32] [--out FILE]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

MB = 1024 * 1024
TOKEN = "bench-player"
DEVICE = "bench/CPU"


def rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def write_input(path: Path, lines: int) -> None:
    with open(path, "w") as f:
        for i in range(lines):
            prompt = f"a watercolour of lighthouse number {i} at dusk, gulls, heavy sea"
            f.write(json.dumps({"prompt": prompt, "seed": i}) + "\n")


def play(url: str) -> None:
    """The farm: every queued job is placed, claimed and finished with one PNG, at once."""
    from PIL import Image

    from sdfarm.store import Store, transport
    from sdfarm.store.records import new_dispatch_id

    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (20, 90, 160)).save(buf, "PNG")
    png = buf.getvalue()
    store = Store.connect(url)
    held = (transport.queue_name(DEVICE), "{}")
    while True:
        store.take_lease(TOKEN, 3_600_000)
        heads = store.snapshot(heads=256).heads
        ids = [(p, j) for p, js in heads.items() for j in js]
        if not ids:
            store.wait_for_wake(0.05)
            continue
        for priority, job_id in ids:
            dispatch = new_dispatch_id()
            if store.place(TOKEN, job_id, priority, DEVICE, dispatch, 1, "loaded", (), held) != 1:
                continue
            store.r.delete(held[0])  # no worker reads it
            if store.claim(job_id, dispatch, "inc", "player") is not None:
                store.finish(job_id, dispatch, DEVICE, "done", meta={"bench": 1}, pngs=[png])


def held(path: str) -> None:
    """The old path's cost: the whole file read into a list of items."""
    from sdfarm.client.batch_input import read_items

    before = rss()
    items = read_items(path)
    print(json.dumps({"items": len(items), "rss_before": before, "rss_after": rss()}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lines", type=int, default=100_000)
    ap.add_argument("--in-flight", type=int, default=32)
    ap.add_argument("--out", default=None)
    ap.add_argument("--play", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--held", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.play:
        return play(args.play)
    if args.held:
        return held(args.held)

    from sdfarm.client.batch import run_batch
    from sdfarm.client.batch_input import iter_items, scan_items
    from sdfarm.client.batch_output import is_done
    from sdfarm.client.farm import Farm
    from sdfarm.localfarm.redis_server import RedisServer

    work = Path(tempfile.mkdtemp(prefix="sdfarm-bench-stream-"))
    data = work / "prompts.jsonl"
    write_input(data, args.lines)
    out = work / "out"
    server = RedisServer.start()
    env = {**os.environ, "SDFARM_RESULT_TTL": "120"}
    player = subprocess.Popen([sys.executable, __file__, "--play", server.url], env=env)
    peak = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.1)

    points: list[dict[str, float]] = []

    def point(label: str, done: int) -> None:
        now = rss()
        points.append({"at": label, "done": done, "rss_mb": round(now / MB, 1)})
        print(f"{label:>10}: {done:>7} written, RSS {now / MB:7.1f} MiB", flush=True)

    try:
        farm = Farm(server.url)
        threading.Thread(target=sample, daemon=True).start()
        point("start", 0)
        t0 = time.monotonic()
        scan = scan_items(data, todo=lambda item: not is_done(out, item))
        scan_s = time.monotonic() - t0
        point("scanned", 0)
        step = max(1, scan.todo // 10)

        def on_progress(kind: str, item: object, n: int) -> None:
            if n % step == 0:
                point(f"{n * 100 // scan.todo}%", n)

        t1 = time.monotonic()
        summary = run_batch(
            farm,
            iter_items(data),
            out,
            "bench-model",
            common={"width": 64, "height": 64, "steps": 1},
            in_flight=args.in_flight,
            on_progress=on_progress,
            total=scan.total,
        )
        batch_s = time.monotonic() - t1
        stop.set()
        point("end", summary.done)
    finally:
        player.terminate()
        player.wait(10)
        server.stop()
    whole = json.loads(
        subprocess.run(
            [sys.executable, __file__, "--held", str(data)], capture_output=True, text=True,
            check=True,
        ).stdout
    )  # fmt: skip
    doc = {
        "bench": "batch_stream_rss",
        "machine": platform.node(),
        "python": platform.python_version(),
        "lines": args.lines,
        "file_mb": round(data.stat().st_size / MB, 1),
        "in_flight": args.in_flight,
        "done": summary.done,
        "failed": summary.failed,
        "scan_s": round(scan_s, 2),
        "batch_s": round(batch_s, 1),
        "images_per_s": round(summary.done / batch_s, 1),
        "points": points,
        "rss_peak_mb": round(peak[0] / MB, 1),
        "rss_growth_scanned_to_end_mb": round(points[-1]["rss_mb"] - points[1]["rss_mb"], 1),
        "old_path_read_whole_mb": round((whole["rss_after"] - whole["rss_before"]) / MB, 1),
    }
    print(json.dumps(doc, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    import shutil

    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
