"""The engine and the farm on a real GPU: figures, memory rules, warm-up, speed, memory, farm.

    python bench/gpu_suite STAGE --out DIR [--backend cuda|vulkan|cpu] [--runtime-dir DIR]
        [--also-runtime BACKEND=DIR ...] [--model DIR] [--taesd-model DIR] [--cli SD_CLI]
        [--runs N] [--sizes 512,1024] [--steps 1,4] [--jobs N] [--deadline SECONDS]

STAGE is one of devices, rules, warmup, speed, memory, farm, or all (in that order). Each
stage writes DIR/gpu-STAGE.json (machine, date, commands, figures; rewritten after every
case, so a stage killed from outside still leaves what it measured) and prints a short table.

- devices: `sdfarm devices --json` under each runtime, next to nvidia-smi.
- rules: another process (torch) holds most of the GPU; the figures under each runtime, the
  full-size model's load (its one warn record and the fit plan), a sparse huge model's
  refusal, then the over-budget case (the GPU held to the last MiB).
- warmup: first and second generation after a load, with and without the engine's warm-up
  (Vulkan also with an empty driver pipeline cache).
- speed: per (size, steps): our `sdfarm generate --in-process` against the runtime's own
  sd-cli on the same inputs, alternated; our engine loaded without warm-up; a steady loop.
- memory: per model and size: estimate, peak RSS (VmHWM), peak GPU memory (NVML, polled from
  this process every 20 ms).
- farm: a local farm (private redis-server, scheduler, one worker) against the in-process
  loop on the same jobs; GPU efficiency; batch_count against separate calls.

Every measurement runs in a fresh child process (`_child`), so nothing leaks between cases.
A case that fails is recorded with its error and the stage goes on; past --deadline no new
case starts (the skipped ones are listed). --backend picks where it computes: cuda and vulkan
load the runtime in --runtime-dir (through SDFARM_RUNTIME_DIR, SDFARM_BACKEND and an alias of
the cache key); cpu computes on the CPU, with the GPUs hidden when --runtime-dir is a GPU
build (so a GPU host needs no separate CPU build).

The package, run as `python bench/gpu_suite ARGS` (its __main__; the children too):

- cli: the arguments, main(), the stages in order (`RUNNERS`), the `_child` entry;
- harness: the deadline, the runtimes, the machine's probes, the stage document (`Stage`);
- children: `run_child` / `child_main` (one fresh process per measurement), NVML polling;
- holder: another process holding GPU memory through torch (rules);
- stage_devices, stage_rules, stage_warmup, stage_speed, stage_memory, stage_farm: a stage
  each, with what only it uses;
- analysis: the pure parts (log parsing, medians, ratios, GPU efficiency, summaries, formats).
"""
