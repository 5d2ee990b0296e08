"""The scheduler at scale: the real scheduler places jobs onto N simulated devices.

Three processes per scenario (devices x models), on a private redis-server:

- `sim`: N simulated devices on N/8 simulated hosts. Each writes its heartbeat through
  `Store.beat` every second (figures, loaded engines, the facts of every model), pops the
  task messages the scheduler pushes on its real Celery queue (`sdfarm.{host}.{device}`, the
  kombu list `CeleryOutbox` names; RPOP, as kombu's BRPOP does), claims the job and finishes
  it after `job_s` through the store transitions a worker uses (`Store.claim`,
  `Store.finish`), loading and LRU-evicting engines as the worker's cache does. Before the
  scheduler starts it queues every job the run can use (`Store.submit`, several submitters
  and every model), so no client runs during the measurement.
- `sched`: the real `sdfarm.scheduler.service.Service` with `Dispatcher.cycle` timed (the
  scheduler's own code, wrapped only to record each cycle's duration and placements).
- this driver: starts them, waits out the warm-up (every device filled), then measures for
  `--seconds`: placements per second, the cycle's p50/p99, the scheduler's CPU per placement
  (/proc, so a busy shared machine does not hide it) and Redis's CPU per placement (INFO cpu
  before and after; it includes the simulated workers' claims, finishes and heartbeats).

`--baseline REV` runs every scenario a second time with the farm's code of git revision REV
(its tree extracted to a temporary folder, put first on PYTHONPATH for both `sim` and
`sched`), side by side in one run, as the machine's load varies.

    python bench/scheduler_scale.py [--grid 10x1,100x10,1000x100] [--seconds 10]
        [--demand 4000] [--baseline main] [--out bench/results/scheduler_scale.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

GiB = 1024**3
HERE = Path(__file__).resolve()
REPO = HERE.parent.parent
DEVICES_PER_HOST = 8
CAPACITY = 24 * GiB
SUBMITTERS = 10


def pct(values: list[float], p: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))]


# -- the simulated devices ---------------------------------------------------------------------


def model_facts(models: int) -> dict[str, dict[str, Any]]:
    """Every model's facts as a worker's heartbeat lists them: 1.5 to 3.5 GiB of files, so an
    estimate is 2.4 to 4.9 GiB and a 24 GiB device holds five to nine engines."""
    return {
        f"model{j:03d}": {
            "bytes": int((1.5 + 0.5 * (j % 5)) * GiB),
            "native_size": [512, 512],
            "decode_per_pixel": 0,
        }
        for j in range(models)
    }


class Device:
    """One simulated device: its engines (LRU), the job it runs and until when."""

    def __init__(self, host: str, name: str) -> None:
        self.host = host
        self.name = name
        self.key = f"{host}/{name}"
        self.incarnation = uuid.uuid4().hex
        self.engines: dict[str, list[float]] = {}  # model -> [estimate, idle_since]
        self.job: tuple[str, str, str] | None = None  # (job id, dispatch, model)
        self.until = 0.0

    def held(self) -> int:
        return int(sum(e[0] for e in self.engines.values()))

    def load(self, model: str, estimate: int, now: float) -> None:
        """The engine cache: keep `model`, evict idle engines least recently used first."""
        if model in self.engines:
            self.engines[model][1] = now
            return
        for name in sorted(self.engines, key=lambda n: self.engines[n][1]):
            if CAPACITY - self.held() >= estimate:
                break
            del self.engines[name]
        self.engines[model] = [float(estimate), now]

    def heartbeat(self, facts: dict[str, Any], wall: float) -> dict[str, Any]:
        held = self.held()
        busy = self.job[2] if self.job else None
        return {
            "host": self.host,
            "device": self.name,
            "key": self.key,
            "backend": "CUDA",
            "type": "gpu",
            "capacity": CAPACITY,
            "compute_figure": max(0, CAPACITY - held),
            "slow_figure": max(0, CAPACITY - held),
            "loaded": [
                {
                    "name": n,
                    "estimate": int(e),
                    "busy": n == busy,
                    "pinned": False,
                    "idle_since": wall - (time.monotonic() - t),
                }
                for n, (e, t) in sorted(self.engines.items())
            ],  # fmt: skip
            "loading": None,
            "models": facts,
            "bad_models": {},
            "loras": {},
            "queue": 0,
            "state": "busy" if self.job else "idle",
            "current_job": self.job[0] if self.job else None,
            "unwritten": {},
            "incarnation": self.incarnation,
            "accepting": True,
            "ts": wall,
        }


def job_args(message: bytes) -> tuple[str, str]:
    """(job id, dispatch) of a Celery task message (protocol 2, base64 JSON body)."""
    import base64

    body = json.loads(base64.b64decode(json.loads(message)["body"]))
    return str(body[0][0]), str(body[0][1])


def sim(args: argparse.Namespace) -> int:
    """The simulated devices (see the module docstring); prints `ready` once the jobs are
    queued and every device has beaten, then runs until SIGTERM and writes its counts."""
    from sdfarm.store import JobSpec, Store, keys
    from sdfarm.store.transport import queue_name

    if args.nice:
        os.nice(args.nice)  # the devices of a real farm run on other machines
    store = Store.connect(args.redis)
    facts = model_facts(args.models)
    names = sorted(facts)
    hosts = max(1, args.devices // DEVICES_PER_HOST)
    every = [Device(f"host{i % hosts:03d}", f"CUDA{i // hosts}") for i in range(args.devices)]
    devices = every[args.shard :: args.shards]  # each device in exactly one process
    for i in range(args.jobs):
        spec = JobSpec(
            model=names[i % len(names)],
            params={"prompt": f"job {i}", "width": 512, "height": 512, "steps": 4},
            submitter=f"user{i % SUBMITTERS}",
        )
        store.submit(spec, default_queue_limit=10 * args.jobs)
    wall = time.time()
    for d in devices:
        store.beat(d.key, d.heartbeat(facts, wall), keys.HEARTBEAT_TTL)
    print("ready", flush=True)

    stop = False

    def on_term(*_: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    queues = [queue_name(d.key) for d in devices]
    next_beat = [time.monotonic() + i / len(devices) for i in range(len(devices))]
    done = claimed = 0
    written = 0.0
    while not stop:
        now = time.monotonic()
        worked = False
        for d in devices:
            if d.job and d.until <= now:
                store.finish(d.job[0], d.job[1], d.key, "done")
                d.engines[d.job[2]][1] = now
                d.job = None
                done += 1
                worked = True
        idle = [i for i, d in enumerate(devices) if d.job is None]
        if idle:
            pipe = store.r.pipeline(transaction=False)
            for i in idle:
                pipe.rpop(queues[i])
            for i, raw in zip(idle, pipe.execute(), strict=True):
                if raw is None:
                    continue
                d = devices[i]
                job_id, dispatch = job_args(raw)
                got = store.claim(job_id, dispatch, d.incarnation, d.key)
                if got is None:
                    continue
                model = json.loads(got.spec)["model"]
                d.load(model, got.estimate, now)
                d.job = (job_id, dispatch, model)
                d.until = now + args.job_s
                claimed += 1
                worked = True
        wall = time.time()
        for i, d in enumerate(devices):
            if next_beat[i] <= now:
                store.beat(d.key, d.heartbeat(facts, wall), keys.HEARTBEAT_TTL)
                next_beat[i] += keys.HEARTBEAT_INTERVAL
        if not worked:
            time.sleep(0.001)
        if args.counts and now - written >= 0.1:
            Path(args.counts + ".tmp").write_text(json.dumps({"done": done, "claimed": claimed}))
            os.replace(args.counts + ".tmp", args.counts)  # whole, for the driver's reads
            written = now
    return 0


# -- the scheduler, its cycles timed --------------------------------------------------------------


def sched(args: argparse.Namespace) -> int:
    """The real scheduler service; each cycle's end time, duration and placements are kept
    and written to `args.out` when it stops (SIGTERM)."""
    from sdfarm.scheduler import service
    from sdfarm.scheduler.dispatch import DispatchConfig, Dispatcher

    out = open(args.out, "a", buffering=1)  # noqa: SIM115 - one line per cycle, until exit
    original = Dispatcher.cycle

    def timed(self: Dispatcher) -> dict[str, int]:
        start = time.perf_counter()
        stats = original(self)
        took = time.perf_counter() - start
        out.write(json.dumps([time.time(), took, int(stats.get("placed", 0))]) + "\n")
        return stats

    from redis.utils import HIREDIS_AVAILABLE

    out.write(json.dumps({"code": service.__file__, "hiredis": HIREDIS_AVAILABLE}) + "\n")
    Dispatcher.cycle = timed  # type: ignore[method-assign]
    svc = service.Service(args.redis, DispatchConfig(queue_limit=10**7))
    signal.signal(signal.SIGTERM, svc.stop)
    svc.run()
    return 0


# -- the driver -----------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def redis_cpu(client: Any) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def source_tree(rev: str, into: Path) -> Path:
    """Revision `rev` of this repository as an importable `sdfarm` under `into`."""
    pkg = into / "sdfarm"
    pkg.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", rev], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(pkg)], input=archive, check=True)
    deps = (pkg / "pyproject.toml").read_text()
    if "hiredis" not in deps:  # redis-py then used its pure-Python parser: so does the run
        (into / "hiredis.py").write_text('raise ImportError("not a dependency at this revision")\n')
    return into


def read_cycles(path: Path) -> tuple[dict[str, Any], list[list[float]]]:
    """What the scheduler process wrote: its code's path and hiredis, then one line a cycle."""
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    head = next((x for x in lines if isinstance(x, dict)), {})
    return head, [x for x in lines if isinstance(x, list)]


def requeues(client: Any) -> int:
    """Jobs the scheduler re-queued (the farm's counters): a simulated device that lost its
    jobs would make placements count twice, so a valid run shows none."""
    from sdfarm.store import keys

    counts = client.hgetall(keys.METRICS_JOBS_KEY)
    return sum(int(v) for k, v in counts.items() if k.startswith(b"requeued|"))


def done_count(tmp: Path) -> int:
    return sum(json.loads(f.read_text())["done"] for f in tmp.glob("counts-*.json"))


def scenario(
    devices: int, models: int, args: argparse.Namespace, tree: Path | None
) -> dict[str, Any]:
    """One run: returns the measured figures."""
    from sdfarm.localfarm.redis_server import RedisServer

    job_s = devices / args.demand
    jobs = int(args.demand * (args.seconds + args.warmup) * 1.1) + 2 * devices + 1000
    shards = max(1, min(4, devices // 250))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    server = RedisServer.start()
    client = server.client()
    tmp = Path(tempfile.mkdtemp(prefix="sched-scale-"))
    cycles_path = tmp / "cycles.jsonl"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        me = [sys.executable, str(HERE)]
        for shard in range(shards):
            sim_p = subprocess.Popen(
                [*me, "sim", "--redis", server.url, "--devices", str(devices), "--models",
                 str(models), "--jobs", str(jobs if shard == 0 else 0), "--job-s", str(job_s),
                 "--counts", str(tmp / f"counts-{shard}.json"), "--shard", str(shard),
                 "--shards", str(shards), "--nice", str(args.sim_nice)],
                stdout=subprocess.PIPE, env=env,
            )  # fmt: skip
            procs.append(sim_p)
            assert sim_p.stdout is not None
            if sim_p.stdout.readline().strip() != b"ready":
                raise RuntimeError("the simulator did not start")
        sims = list(procs)
        sched_p = subprocess.Popen(
            [*me, "sched", "--redis", server.url, "--out", str(cycles_path)], env=env
        )
        procs.append(sched_p)
        started = time.time()
        time.sleep(args.warmup)
        t0, r0, s0 = time.time(), redis_cpu(client), cpu_seconds(sched_p.pid)
        m0 = sum(cpu_seconds(p.pid) for p in sims)
        done0 = done_count(tmp)
        time.sleep(args.seconds)
        t1, r1, s1 = time.time(), redis_cpu(client), cpu_seconds(sched_p.pid)
        m1 = sum(cpu_seconds(p.pid) for p in sims)
        done1 = done_count(tmp)
        requeued = requeues(client)
        head, cycles = read_cycles(cycles_path)
        deadline = time.monotonic() + args.patience
        while not any(c[2] for c in cycles) and time.monotonic() < deadline:
            time.sleep(1)  # the first placing cycle has not ended yet: wait for its length
            head, cycles = read_cycles(cycles_path)
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        server.stop()
    first = next((c for c in cycles if c[2]), None)
    inside = [c for c in cycles if t0 <= c[0] <= t1]
    placed = sum(c[2] for c in inside)
    busy = [c[1] for c in inside if c[2] > 0]
    return {
        "devices": devices,
        "models": models,
        "hosts": max(1, devices // DEVICES_PER_HOST),
        "job_s": round(job_s, 4),
        "window_s": round(t1 - t0, 2),
        "placed": placed,
        "placements_per_s": round(placed / (t1 - t0), 1),
        "finished_per_s": round((done1 - done0) / (t1 - t0), 1),
        "cycles": len(inside),
        "cycle_p50_ms": round(pct([c[1] for c in inside], 50) * 1e3, 2),
        "cycle_p99_ms": round(pct([c[1] for c in inside], 99) * 1e3, 2),
        "placing_cycle_p50_ms": round(pct(busy, 50) * 1e3, 2),
        "placed_per_cycle": round(placed / max(1, len(busy)), 1),
        "first_placing_cycle_ms": round(first[1] * 1e3, 1) if first else None,
        "first_placing_cycle_ended_s": round(first[0] - started, 1) if first else None,
        "sched_cpu_ms_per_placement": round((s1 - s0) / max(1, placed) * 1e3, 3)
        if placed
        else None,
        "sched_cpu_share": round((s1 - s0) / (t1 - t0), 2),
        "sim_cpu_share": round((m1 - m0) / (t1 - t0), 2),
        "redis_cpu_us_per_placement": round((r1 - r0) / max(1, placed) * 1e6, 1)
        if placed
        else None,
        "redis_cpu_share": round((r1 - r0) / (t1 - t0), 2),
        "requeued": requeued,
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "sched_code": str(Path(head.get("code", "?")).parent.parent),
        "hiredis": head.get("hiredis"),
    }


def drive(args: argparse.Namespace) -> int:
    grid = [tuple(int(x) for x in cell.split("x")) for cell in args.grid.split(",")]
    out: dict[str, Any] = {
        "sim_nice": args.sim_nice,
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "demand_per_s": args.demand,
        "seconds": args.seconds,
        "rows": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        variants: list[tuple[str, Path | None]] = [("this tree", None)]
        if args.baseline:
            rev = subprocess.run(
                ["git", "-C", str(REPO), "rev-parse", "--short", args.baseline],
                check=True, capture_output=True, text=True,
            ).stdout.strip()  # fmt: skip
            variants.insert(0, (f"baseline {rev}", source_tree(rev, Path(tmp) / "base")))
        for devices, models in grid:
            for name, tree in variants:
                row = {"code": name, **scenario(devices, models, args, tree)}
                print(json.dumps(row), flush=True)
                out["rows"].append(row)
    text = json.dumps(out, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="role")
    d = sub.add_parser("drive", help="run the grid (the default)")
    for p in (ap, d):
        p.add_argument("--grid", default="10x1,100x10,1000x100", help="DEVICESxMODELS,...")
        p.add_argument("--seconds", type=float, default=10.0)
        p.add_argument("--warmup", type=float, default=4.0)
        p.add_argument("--demand", type=float, default=4000.0,
                       help="jobs/s the devices could finish together (sets job_s)")  # fmt: skip
        p.add_argument("--baseline", help="also run the farm's code of this git revision")
        p.add_argument("--out", type=Path)
        p.add_argument("--sim-nice", type=int, default=0,
                       help="run the simulated devices at this niceness")  # fmt: skip
        p.add_argument("--patience", type=float, default=90.0,
                       help="seconds to wait for a first placing cycle")  # fmt: skip
    s = sub.add_parser("sim")
    s.add_argument("--redis", required=True)
    s.add_argument("--devices", type=int, required=True)
    s.add_argument("--models", type=int, required=True)
    s.add_argument("--jobs", type=int, required=True)
    s.add_argument("--job-s", type=float, required=True)
    s.add_argument("--counts")
    s.add_argument("--shard", type=int, default=0)
    s.add_argument("--nice", type=int, default=0)
    s.add_argument("--shards", type=int, default=1)
    c = sub.add_parser("sched")
    c.add_argument("--redis", required=True)
    c.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.role == "sim":
        return sim(args)
    if args.role == "sched":
        return sched(args)
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
