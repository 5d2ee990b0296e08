"""Stage farm: a local farm (private redis-server, scheduler, one worker) against the
in-process loop on the same jobs; GPU efficiency; batch_count against separate calls."""

from __future__ import annotations

import argparse
import time
from collections import deque
from pathlib import Path
from typing import Any

from .analysis import (
    added_per_job,
    child_status,
    fmt_s,
    gpu_efficiency,
    median,
    parse_sizes,
    per_second,
    ratio,
)
from .children import gens_spec, run_child
from .harness import CaseError, Deadline, Runtime, Stage, error_text


def stage_farm(args: argparse.Namespace, deadline: Deadline, runtimes: list[Runtime]) -> None:
    st = Stage("farm", args, deadline, runtimes)
    rt = runtimes[0]
    w, h = parse_sizes(args.sizes)[0]
    jobs, bc = args.jobs, args.batch_count
    model_dir = Path(args.model).resolve()
    name = model_dir.name
    common = {"width": w, "height": h, "steps": 1}
    s: dict[str, Any] = {
        "jobs": jobs,
        "size": f"{w}x{h}",
        "steps": 1,
        "workers": 1,
        "batch_count": bc,
        "device": rt.worker_device,
    }
    st.doc["summary"] = s

    def inproc() -> dict[str, Any]:
        gens = (
            gens_spec(1, w, h, 1, group="warm", png=True)
            + gens_spec(jobs, w, h, 1, group="jobs", png=True, seed0=1000)
            + gens_spec(
                1,
                w,
                h,
                1,
                group="batch",
                png=True,
                seed0=5000,
                prompt="same prompt",
                batch_count=bc,
            )
            + gens_spec(bc, w, h, 1, group="calls", png=True, seed0=5000, prompt="same prompt")
        )
        spec = {"model": str(model_dir), "device": rt.device, "log_level": "none", "gens": gens}
        env = rt.env()
        st.child_command(spec, env)
        res = run_child(spec, env, deadline.child_timeout(args.case_timeout * 2))
        g = res.get("gens") or []
        errs = [x["error"] for x in g if x.get("error")] + (
            [res["error"]] if res.get("error") else []
        )
        if errs:
            raise CaseError(str(errs[0]))
        if len(g) < len(gens):
            raise CaseError(
                f"only {len(g)} of {len(gens)} generations (exit {res.get('returncode')}: "
                f"{res.get('stderr_tail', '')[-800:]})"
            )

        def grp(n: str) -> list[dict[str, Any]]:
            return [x for x in g if x.get("group") == n]

        jw = sum(x["wall_s"] for x in grp("jobs"))
        jg = [x["generate_s"] for x in grp("jobs")]
        bw = sum(x["wall_s"] for x in grp("batch"))
        cw = sum(x["wall_s"] for x in grp("calls"))
        out = {
            "jobs_wall_s": jw,
            "jobs_generate_sum_s": sum(jg),
            "jobs_generate_median_s": median(jg),
            "images_per_s": per_second(len(jg), jw),
            "efficiency": gpu_efficiency(jg, 1, jw),
            "batch_wall_s": bw,
            "batch_images": sum(x["images"] for x in grp("batch")),
            "calls_wall_s": cw,
            "batch_images_per_s": per_second(sum(x["images"] for x in grp("batch")), bw),
            "calls_images_per_s": per_second(len(grp("calls")), cw),
            "load_s": res.get("load_s"),
            "warmup_s": res.get("warmup_s"),
            **child_status(res),
        }
        s["in_process"] = out
        return out

    st.case(f"in-process: {jobs} jobs + batch_count {bc}", inproc)

    from sdfarm.client.farm import Farm, FarmBusyError
    from sdfarm.localfarm.farm import LocalFarm

    if deadline.expired():
        st.skip("farm", "deadline")
        _farm_table(st, s)
        return
    log_dir = Path(args.farm_log_dir or Path(args.out) / "farm-logs")
    env = rt.env()
    worker_args = ["--pin", name]
    st.command(
        f"LocalFarm([{model_dir.parent}], devices=[{rt.worker_device}], "
        f"worker_args={worker_args}) (redis-server, python -m sdfarm.scheduler.service, "
        f"python -m sdfarm.worker.main --device {rt.worker_device} --pin {name})",
        env,
    )
    local = LocalFarm(
        [model_dir.parent],
        devices=[rt.worker_device],
        announce=False,
        log_dir=log_dir,
        env=env,
        worker_args=worker_args,
        ready_timeout=deadline.child_timeout(240),
    )
    t = time.perf_counter()
    try:
        local.start()
    except Exception as e:  # noqa: BLE001
        st.doc["errors"].append({"case": "start farm", "error": error_text(e)})
        st.doc["cases"].append({"case": "start farm", "ok": False, "error": error_text(e)})
        _farm_table(st, s)
        return
    s["farm_start_s"] = round(time.perf_counter() - t, 3)
    tmo = args.case_timeout
    try:
        with Farm(local.url) as farm:

            def warm() -> dict[str, Any]:
                r = [
                    farm.submit(name, "warm", seed=i, **common).result(timeout=tmo)
                    for i in range(2)
                ]
                return {"timings": [x.metadata.get("timings") for x in r]}

            st.case("farm warm-up jobs", warm)

            def sequential() -> dict[str, Any]:
                lat, gen = [], []
                for i in range(min(jobs, args.seq_jobs)):
                    t0 = time.perf_counter()
                    r = farm.submit(name, f"seq {i}", seed=100 + i, **common).result(timeout=tmo)
                    lat.append(time.perf_counter() - t0)
                    gen.append(r.metadata["timings"]["generate_s"])
                added = [a - g for a, g in zip(lat, gen, strict=True)]
                out = {
                    "n": len(lat),
                    "latency_median_s": median(lat),
                    "generate_median_s": median(gen),
                    "added_median_s": median(added),
                    "added_max_s": max(added) if added else None,
                }
                s["sequential"] = out
                return out

            st.case(f"farm sequential {min(jobs, args.seq_jobs)} jobs", sequential)

            def batch() -> dict[str, Any]:
                t0 = time.perf_counter()
                pending: deque[Any] = deque()
                results = []
                for i in range(jobs):
                    while True:
                        try:
                            pending.append(
                                farm.submit(name, f"farm job {i}", seed=1000 + i, **common)
                            )
                            break
                        except FarmBusyError:
                            if not pending:
                                raise
                            results.append(pending.popleft().result(timeout=tmo))
                submitted = time.perf_counter() - t0
                while pending:
                    results.append(pending.popleft().result(timeout=tmo))
                makespan = time.perf_counter() - t0
                tim = [r.metadata.get("timings", {}) for r in results]
                gen = [x["generate_s"] for x in tim]
                out = {
                    "n": len(results),
                    "makespan_s": makespan,
                    "submit_s": submitted,
                    "generate_sum_s": sum(gen),
                    "generate_median_s": median(gen),
                    "efficiency": gpu_efficiency(gen, 1, makespan),
                    "images_per_s": per_second(len(results), makespan),
                    "encode_median_s": median(x.get("encode_s") for x in tim),
                    "queued_median_s": median(x.get("queued_s") for x in tim),
                }
                base = s.get("in_process") or {}
                if base.get("jobs_wall_s"):
                    out["added_per_job_s"] = added_per_job(makespan, base["jobs_wall_s"], jobs)
                    out["throughput_vs_in_process"] = ratio(
                        out["images_per_s"], base["images_per_s"]
                    )
                s["farm"] = out
                return out

            st.case(f"farm batch {jobs} jobs", batch)

            def batch_count() -> dict[str, Any]:
                t0 = time.perf_counter()
                r = farm.submit(name, "same prompt", seed=5000, batch_count=bc, **common).result(
                    timeout=tmo
                )
                one_wall = time.perf_counter() - t0
                t1 = time.perf_counter()
                js = [farm.submit(name, "same prompt", seed=5000 + i, **common) for i in range(bc)]
                rs = [j.result(timeout=tmo) for j in js]
                many_wall = time.perf_counter() - t1
                out = {
                    "batch_images": len(r.pngs),
                    "batch_wall_s": one_wall,
                    "batch_generate_s": r.metadata.get("timings", {}).get("generate_s"),
                    "batch_images_per_s": per_second(len(r.pngs), one_wall),
                    "calls_wall_s": many_wall,
                    "calls_generate_sum_s": sum(x.metadata["timings"]["generate_s"] for x in rs),
                    "calls_images_per_s": per_second(len(rs), many_wall),
                }
                s["farm_batch_count"] = out
                return out

            st.case(f"farm batch_count {bc} vs {bc} jobs", batch_count)
    finally:
        local.stop()
    _farm_table(st, s)


def _ms(v: float | None) -> float | None:
    return None if v is None else v * 1e3


def _farm_table(st: Stage, s: dict[str, Any]) -> None:
    ip, fm = s.get("in_process") or {}, s.get("farm") or {}
    sq, bc = s.get("sequential") or {}, s.get("farm_batch_count") or {}
    lines = [
        f"{s['jobs']} jobs {s['size']} 1 step on {s['device']}, one worker",
        f"{'':34} {'in-process':>11} {'farm':>11}",
        f"{'wall / makespan s':<34} {fmt_s(ip.get('jobs_wall_s'), 2):>11} "
        f"{fmt_s(fm.get('makespan_s'), 2):>11}",
        f"{'sum of generate_s':<34} {fmt_s(ip.get('jobs_generate_sum_s'), 2):>11} "
        f"{fmt_s(fm.get('generate_sum_s'), 2):>11}",
        f"{'images/s':<34} {fmt_s(ip.get('images_per_s'), 2):>11} "
        f"{fmt_s(fm.get('images_per_s'), 2):>11}",
        f"{'GPU efficiency (target >= 0.95)':<34} {fmt_s(ip.get('efficiency')):>11} "
        f"{fmt_s(fm.get('efficiency')):>11}",
        f"{'farm added per job (batch) ms':<34} {'':>11} "
        f"{fmt_s(_ms(fm.get('added_per_job_s')), 1):>11}",
        f"{'sequential added latency p50 ms':<34} {'':>11} "
        f"{fmt_s(_ms(sq.get('added_median_s')), 1):>11}",
        f"{'batch_count images/s':<34} {fmt_s(ip.get('batch_images_per_s'), 2):>11} "
        f"{fmt_s(bc.get('batch_images_per_s'), 2):>11}",
        f"{'same prompt, separate calls img/s':<34} {fmt_s(ip.get('calls_images_per_s'), 2):>11} "
        f"{fmt_s(bc.get('calls_images_per_s'), 2):>11}",
    ]
    st.finish(lines)
