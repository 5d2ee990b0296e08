#!/usr/bin/env bash
# The GPU suite on the lent H200 machine, run from the repository root, in three phases of
# about 9 minutes each (every command there is killed at 10 minutes):
#
#   bash bench/gpu_run.sh setup     # CUDA build (+ sd-cli) or the carried one, models, devices, rules
#   bash bench/gpu_run.sh bench1    # warm-up (cuda, vulkan), speed cuda against sd-cli
#   bash bench/gpu_run.sh bench2    # farm (cuda), memory (cuda, vulkan), speed vulkan, speed cpu
#   bash bench/gpu_run.sh cudafarm  # CUDA only: farm (cuda), speed cuda at 1024 against sd-cli
#   bash bench/gpu_run.sh overhead  # farm_overhead.py on CUDA0 (full-size model at 256 and 512)
#   bash bench/gpu_run.sh speedbatch # speed vs sd-cli incl. one call of 6 images; overhead at 256
#   bash bench/gpu_run.sh gputests  # pytest tests/gpu on CUDA0 (tiny model, then full-size)
#   bash bench/gpu_run.sh cpu1024   # one 1024x1024 image on the CPU alone
#   bash bench/gpu_run.sh twogpu    # two GPUs: choice, warning, refusal sum, two-worker batch
#   bash bench/gpu_run.sh features  # peak vs estimate of img2img/inpaint/hires; step caches
#   bash bench/gpu_run.sh tiling    # VAE tiling table; 4096x4096 under a figure refusing it untiled
#   bash bench/gpu_run.sh peer      # engines per GPU; the diffusers peer, eager and compiled
#   bash bench/gpu_run.sh tilingpeer # both in one call
#   bash bench/gpu_run.sh decodefarm # size limit, decode options, efficiency, 5,000-job batch
#   bash bench/gpu_run.sh lanes     # engine slots: batch, images/s per N, GPU busy fraction
#   bash bench/gpu_run.sh extras    # video and ControlNet peak vs estimate; the farm with TAESD
#   bash bench/gpu_run.sh decodefarm # CUDA size limit (#12), VAE decode options and 500-job
#                                    # GPU efficiency (#15), 5,000-job file-store batch (#14)
#   bash bench/gpu_run.sh cudaopts  # ggml's CUDA options side by side (a second build with CUDA
#                                   # graphs); LoRA peak vs estimate; 1024 x 4 steps; TAESD 4 steps
#   bash bench/gpu_run.sh vulkan    # the carried Vulkan build with cooperative-matrix shaders:
#                                   # speed, 4096x4096 under a 40 GiB figure, the farm per N
#   bash bench/gpu_run.sh vkcheck   # the VAE-attention estimate at 2048 and 4096 on Vulkan
#   bash bench/gpu_run.sh peerone   # build, then the farm per N at 512/1024 x 1/4 steps
#   bash bench/gpu_run.sh peertwo   # right after peerone: the same under CUDA MPS; the peer
#   bash bench/gpu_run.sh peerthree # MPS at N = 4, 8
#   bash bench/gpu_run.sh effprefetch # 500 jobs, SDFARM_PREFETCH 1 and 2; the MPS probe
#   bash bench/gpu_run.sh nextlease # chained jobs off/on over 500 jobs; I2V video peak; TAESD + MPS
#   bash bench/gpu_run.sh chainlease # nextlease's first half: chained jobs off/on over 500 jobs
#   bash bench/gpu_run.sh i2vmps    # its second half: the I2V video peak; TAESD under MPS
#   bash bench/gpu_run.sh lookahead # 500 jobs with the chain's lookahead off, on, on again
#   bash bench/gpu_run.sh profile   # kernel-by-kernel profile of an image at 512 and 1024
#   bash bench/gpu_run.sh lookprofile # lookahead, then profile
#   bash bench/gpu_run.sh im2col2   # the tiled im2col against ggml's kernel (same build):
#                                   # ms/image, same pixels; the farm under MPS (N=4); the peer
#   bash bench/gpu_run.sh im2col4   # the 4-step cases under MPS (N=4) with the tiled im2col
#   bash bench/gpu_run.sh gnorm     # the split group norm against ggml's (same build), then
#                                   # the farm under MPS (N=4) at the peer table's four cases
#   bash bench/gpu_run.sh gnormpeer # right after gnorm: diffusers eager b1, compiled b4; the
#                                   # kernel profile at 1024 with both patches
#   bash bench/gpu_run.sh im2colvec # build here; im2col with 1/2/4 values per store; the farm
#                                   # under MPS (N=4) with the fastest; the peer's eager b1
#   bash bench/gpu_run.sh vecmore   # build here; 500-job GPU efficiency; 1024 under MPS, N=4, 8
#   bash bench/gpu_run.sh effahead  # build here; 500-job GPU efficiency, lookahead on/off/on
#   bash bench/gpu_run.sh effbacklog # build here; effahead's runs with the backlog change
#   bash bench/gpu_run.sh cublas32  # after effahead: cuBLAS f32 output side by side; the farm
#                                   # under MPS (N=4) with the faster; the peer's eager b1
#   bash bench/gpu_run.sh cudnnall  # build here; convolutions through cuDNN (experimental)
#                                   # against im2col: ms, pixels, GPU memory; the farm under
#                                   # MPS (N=4) at the four cases with the fastest; the peer's b1
#   bash bench/gpu_run.sh cudnndebug # why a cuDNN process crashed: traced image, backtrace
#   bash bench/gpu_run.sh cudnnwhy  # build here; the cuDNN checks in Python and beside an engine,
#                                   # traced images per setting, then the first that works measured
#   bash bench/gpu_run.sh cudnnfix  # build here; after the libstdc++ fix: a traced image, cuDNN
#                                   # (heuristics, cudnnFind) against im2col, peak vs estimate
#   bash bench/gpu_run.sh cudnnfarm # cudnnfix's build carried: the farm through cuDNN under MPS
#                                   # at the peer table's cases (N = 4; 2, 8 at 1024); eager b1
#   bash bench/gpu_run.sh cudnnn8   # the same carried: the 4-step cases at N = 8; eager b1
#   bash bench/gpu_run.sh cudnndecode # the same carried: the decode table, direct = cuDNN
#   bash bench/gpu_run.sh peer512c  # the peer at 512: eager batch 1, compiled batch 4
#   bash bench/gpu_run.sh cudnnalone # cuDNN alone (bench/cudnn_check.cpp), no build needed
#   bash bench/gpu_run.sh sdpa      # build here (with attention through cuDNN where the carried
#                                   # frontend wheel gives its headers); SDPA on/off side by side;
#                                   # the farm under MPS (N=4) at the peer's cases; eager b1
#   bash bench/gpu_run.sh sdpapeer  # sdpa's build carried: 1024 x 4 steps with and without
#                                   # cuDNN's attention; the farm at 1024 (N=4, 8); eager b1 and
#                                   # compiled b4 at 1024 with what is left
#   bash bench/gpu_run.sh sdpatable # sdpa's build carried: the farm (N=8, MPS) at the four cases,
#                                   # eager b1, compiled b4 at 512 with what is left
#   bash bench/gpu_run.sh fuse      # build here (the linear and layer-norm fusions); one engine
#                                   # with and without them at 4 steps; the farm (N=8, MPS) at 4 steps
#   bash bench/gpu_run.sh fusetable # fuse's build: the farm (N=8, MPS) at the four cases, eager
#                                   # b1, compiled b4 at 512
#   bash bench/gpu_run.sh fusepeer  # after fusetable: compiled b4 at 1024, eager b1, the farm again
#   bash bench/gpu_run.sh fusemore  # fuse's build carried: one engine with/without at 1024 x 4;
#                                   # the farm (MPS) at N = 1, 2, 4 at 1024 x 4
#   bash bench/gpu_run.sh attnfuse  # build here (+ the self-attention fusion); one engine with
#                                   # and without it at 4 steps; the farm (N=8, MPS) at 4 steps
#   bash bench/gpu_run.sh attntable # attnfuse's build: the farm (N=8, MPS) at the four cases
#   bash bench/gpu_run.sh attnpeer  # then the peer: eager b1, compiled b4 at 512 and 1024
#   bash bench/gpu_run.sh attndefault # build here, the attention fusion on by default: one engine
#                                   # with/without it; the farm (MPS) at 512 x 4, N = 8, 12
#   bash bench/gpu_run.sh attnquick # its first half: build, one engine with/without at 1024 x 4
#   bash bench/gpu_run.sh batch     # build here; one engine, 4-image jobs sampled together and
#                                   # one by one; the farm (MPS, N=8) with 4-image jobs
#   bash bench/gpu_run.sh batchtable # batch's build: the farm, 4-image jobs, four cases; eager b1
#   bash bench/gpu_run.sh batchpeer # the peer's compiled batch 4 at 512, then 1024
#   bash bench/gpu_run.sh batchbig  # build here; 4 images at 1984 and 8 at 1024 on both CUDA paths
#   bash bench/gpu_run.sh moreengines # fuse's build carried: the farm at N = 8, 12, 16 at 512
#   bash bench/gpu_run.sh fattn     # ggml's flash attention alone at the UNet's shapes, per
#                                   # configuration of its head-size-64 kernel; torch's SDPA
#
# Carried: .whl/*.whl (our dependencies for python3.12; .whl-peer/*.whl the peer's diffusers and
# transformers, for the calls that run it), .carry/{redis-server,
# stable_diffusion_cpp_python-0.4.7.tar.gz}; for the Vulkan stages also .gl/*.deb (Vulkan
# loader + glvnd) and .carry/vulkan-runtime.tar.xz (each used only when present); and, once a
# setup has built it, .carry/cuda-runtime.tar.xz (or its .part-NN pieces: 47 MB in 3). The
# sdist (20.5 MB) is needed only to build: with the runtime's pieces, .whl and the tree there
# is no room for it under the 64 MiB a call may carry, so carry one or the other.
#
# The machine keeps /tmp only while it stays warm (30 s after a call), so every phase makes
# sure of what it needs: the CUDA runtime (from /tmp, else unpacked from .carry, else built:
# about 4.5 minutes, then packed into $OUT/cuda-runtime.tar.xz to carry next time) and the
# full-size models (about a minute). Each suite command gets a deadline from what is left
# of PHASE_BUDGET, so a phase that starts cold still ends in time, having skipped (and
# recorded) what did not fit. Results: $OUT/<backend>/gpu-STAGE.json and $OUT/log-PHASE.txt
# (at most 8 files come back per call).
set -u

REPO=$(pwd)
PHASE=${1:-}
OUT=${OUT:-/tmp/gpu-out}
PHASE_BUDGET=${PHASE_BUDGET:-540}   # seconds; each command is killed at 600
T0=$(date +%s)
PY=${PY:-python3}
MODELS=${MODELS:-/tmp/models}
MODEL=$MODELS/sd-turbo-random
TAESD=$MODELS/sd-turbo-random-taesd
VKRT=/tmp/vkrt
CUDART=/tmp/cudart
CUDA_JSON=${CUDA_JSON:-/tmp/cuda-build.json}
CUDA_TAR=.carry/cuda-runtime.tar.xz
FARM_LOGS=/tmp/gpu-farm-logs
MPID=""

now() { echo $(( $(date +%s) - T0 )); }
say() { echo "[$(now)s] $*"; }

prep() {
    if [ ! -e /tmp/.sdfarm-gl ] && compgen -G '.gl/*.deb' >/dev/null; then
        for f in .gl/*.deb; do dpkg -x "$f" /; done
        ldconfig && touch /tmp/.sdfarm-gl
    fi
    export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
    if [ "${DRY:-0}" != 1 ] && [ ! -e /tmp/site/.sdfarm-done ]; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl && touch /tmp/site/.sdfarm-done
    fi
    mkdir -p /tmp/pkg/sdfarm
    for d in native worker scheduler store client cli localfarm; do
        ln -sfn "$REPO/$d" "/tmp/pkg/sdfarm/$d"
    done
    # The peer's wheels (diffusers, transformers and what they need beyond .whl), carried in
    # .whl-peer by the calls that run the peer; a target of their own, since both sets have a
    # bin/ that pip's --upgrade would replace.
    if [ "${DRY:-0}" != 1 ] && [ ! -e /tmp/site-peer/.sdfarm-done ] &&
        compgen -G '.whl-peer/*.whl' >/dev/null; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site-peer .whl-peer/*.whl && touch /tmp/site-peer/.sdfarm-done
    fi
    export PYTHONPATH=/tmp/site:/tmp/site-peer:/tmp/pkg
    [ -e .carry/redis-server.xz ] && [ ! -e .carry/redis-server ] && xz -dk .carry/redis-server.xz
    chmod +x .carry/redis-server 2>/dev/null
    export PATH="$REPO/.carry:$PATH"
    for d in /usr/local/cuda/bin /usr/local/cuda-*/bin; do
        if [ -x "$d/nvcc" ]; then export PATH="$PATH:$d"; break; fi
    done
    export SDFARM_CACHE=/tmp/sdfcache
    mkdir -p "$SDFARM_CACHE/sdist"
    [ -e .carry/stable_diffusion_cpp_python-0.4.7.tar.gz ] &&
        cp -n .carry/stable_diffusion_cpp_python-0.4.7.tar.gz "$SDFARM_CACHE/sdist/"
    if [ ! -e "$VKRT/build.json" ] && [ -e .carry/vulkan-runtime.tar.xz ]; then
        mkdir -p "$VKRT" && tar xJf .carry/vulkan-runtime.tar.xz -C "$VKRT"
    fi
    export PYTHONUNBUFFERED=1
    mkdir -p "$OUT"
    say "prepared: $(nproc) cores; $(nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>&1)"
}

cuda_built() {
    [ -s "$CUDA_JSON" ] && $PY -c "
import json, os, sys
d = json.load(open('$CUDA_JSON'))
cli = d.get('cli')  # a carried runtime may leave sd-cli out (the carry's 64 MiB)
sys.exit(0 if os.path.exists(d['library']) and (d.get('carried') or cli and os.path.exists(cli)) else 1)"
}

cuda_field() { $PY -c "import json; print(json.load(open('$CUDA_JSON'))['$1'])"; }

models_ready() {
    [ -e "$MODEL/model.json" ] && [ -e "$TAESD/model.json" ] &&
        [ -e "$MODELS/loras/sd-turbo-lora.safetensors" ]
}

models_start() {
    if models_ready || [ -n "$MPID" ]; then return; fi
    say "writing the full-size models in the background (about a minute)"
    ( $PY bench/fullsize_model.py "$MODELS" --taesd --lora 2>&1 | sed 's/^/[models] /' ) &
    MPID=$!
}

models_wait() {
    if [ -n "$MPID" ]; then wait "$MPID"; MPID=""; say "models written"; fi
}

pack_cuda() {
    local dir; dir=$(cuda_field directory)
    tar -C "$dir" -cf - libstable-diffusion.so sd-cli include build.json | ${PACK_NICE:-} xz -T0 -6 \
        > /tmp/cuda-runtime.tar.xz
    local size; size=$(stat -c %s /tmp/cuda-runtime.tar.xz)
    if [ "$size" -le $(( 16 * 1024 * 1024 - 65536 )) ]; then
        cp /tmp/cuda-runtime.tar.xz "$OUT/"
    else
        # pieces just under the 16 MiB a returned file may have (47 MB: 3 pieces)
        split -b 16000K -d /tmp/cuda-runtime.tar.xz "$OUT/cuda-runtime.tar.xz.part-"
    fi
    say "packed the CUDA runtime ($size bytes): carry $(cd "$OUT" && echo cuda-runtime.tar.xz*) in .carry/ next time"
}

# With PACK_LATER=1 a fresh build is packed in the background (nice) while the first,
# timing-insensitive stage runs; pack_wait waits for it.
PACK_PID=""
pack_wait() {
    if [ -n "$PACK_PID" ]; then wait "$PACK_PID"; PACK_PID=""; fi
}

cuda_ensure() {
    if cuda_built; then
        say "CUDA runtime: $(cuda_field directory)"
        return
    fi
    if [ -e "$CUDA_TAR" ] || ls "$CUDA_TAR".part-* >/dev/null 2>&1; then
        say "unpacking the carried CUDA runtime into $CUDART"
        rm -rf "$CUDART" && mkdir -p "$CUDART"
        if [ -e "$CUDA_TAR" ]; then cat "$CUDA_TAR"; else cat "$CUDA_TAR".part-*; fi |
            tar xJf - -C "$CUDART"
        $PY -c "
import json
print(json.dumps({'directory': '$CUDART', 'library': '$CUDART/libstable-diffusion.so',
                  'cli': '$CUDART/sd-cli', 'carried': True}))" > "$CUDA_JSON"
        cuda_built && return
        say "the carried CUDA runtime is incomplete; building instead"
        rm -f "$CUDA_JSON"
    fi
    say "building the CUDA runtime + sd-cli (about 4.5 minutes)"
    command -v nvcc >/dev/null || say "WARNING: nvcc is not on the PATH"
    if $PY -m sdfarm.native.build --backend cuda --with-cli \
        --cmake-arg=-DCMAKE_CUDA_ARCHITECTURES=90 --json > "$CUDA_JSON.part"; then
        mv "$CUDA_JSON.part" "$CUDA_JSON"
        say "built: $(cat "$CUDA_JSON")"
        if [ "${NOPACK:-0}" = 1 ]; then
            say "not packed (NOPACK=1)"
        elif [ "${PACK_LATER:-0}" = 1 ]; then
            PACK_NICE="nice -n 19" pack_cuda &
            PACK_PID=$!
        else
            pack_cuda
        fi
    else
        say "CUDA build FAILED"
        for f in "$SDFARM_CACHE"/runtime/*/build.log; do
            [ -e "$f" ] && { echo "== $f"; tail -40 "$f"; }
        done
    fi
}

# Everything a bench needs: the CUDA runtime and the models (written while the build runs).
ensure() {
    prep
    models_start
    cuda_ensure
    models_wait
    if ! cuda_built || ! models_ready; then
        say "the CUDA runtime or the models are missing: nothing to measure"
        exit 3
    fi
    CUDA_DIR=$(cuda_field directory)
    CLI=$(cuda_field cli)
}

# on_cuda SECONDS ARGS...: python ARGS on the CUDA runtime `ensure` found, killed after SECONDS
# (STAGE_BACKEND and STAGE_RUNTIME, when set, name another runtime: the Vulkan build).
on_cuda() {
    local limit=$1; shift
    SDFARM_BACKEND=${STAGE_BACKEND:-${DRY_BACKEND:-cuda}} SDFARM_RUNTIME_DIR="${STAGE_RUNTIME:-$CUDA_DIR}" \
        timeout "$limit" $PY "$@"
}

# suite BUDGET STAGE ARGS...: one suite command with --deadline min(BUDGET, what is left of
# the phase - 30 s), stopped (TERM, then KILL) if it would outlive the phase.
suite() {
    local budget=$1; shift
    local left=$(( PHASE_BUDGET - $(now) ))
    if [ "$left" -lt 45 ]; then say "SKIPPED (phase budget spent): gpu_suite $*"; return; fi
    local dl=$(( budget < left - 30 ? budget : left - 30 ))
    say "gpu_suite $* --deadline $dl"
    timeout -k 10 $(( left - 5 )) $PY bench/gpu_suite "$@" --deadline "$dl"
    local rc=$?
    [ $rc -eq 0 ] || say "gpu_suite $1 exited $rc"
}

setup() {
    ensure
    suite 60 devices --out "$OUT/cuda" --backend cuda --runtime-dir "$CUDA_DIR" \
        --also-runtime "vulkan=$VKRT" --model "$MODEL"
    suite 200 rules --out "$OUT/cuda" --backend cuda --runtime-dir "$CUDA_DIR" \
        --also-runtime "vulkan=$VKRT" --model "$MODEL" --sizes 512
    nvidia-smi || true
}

bench1() {
    ensure
    suite 50 warmup --out "$OUT/cuda" --backend cuda --runtime-dir "$CUDA_DIR" \
        --model "$MODEL" --sizes 512 --runs 2
    suite 100 warmup --out "$OUT/vulkan" --backend vulkan --runtime-dir "$VKRT" \
        --model "$MODEL" --sizes 512 --runs 2
    suite 600 speed --out "$OUT/cuda" --backend cuda --runtime-dir "$CUDA_DIR" --cli "$CLI" \
        --model "$MODEL" --sizes 512,1024 --steps 1,4 --runs 5
}

bench2() {
    ensure
    suite 180 farm --out "$OUT/cuda" --backend cuda --runtime-dir "$CUDA_DIR" \
        --model "$MODEL" --sizes 512 --jobs 200 --batch-count 8 --farm-log-dir "$FARM_LOGS"
    suite 45 memory --out "$OUT/cuda" --backend cuda --runtime-dir "$CUDA_DIR" \
        --model "$MODEL" --taesd-model "$TAESD" --sizes 512,1024
    suite 60 memory --out "$OUT/vulkan" --backend vulkan --runtime-dir "$VKRT" \
        --model "$MODEL" --taesd-model "$TAESD" --sizes 512,1024
    suite 90 speed --out "$OUT/vulkan" --backend vulkan --runtime-dir "$VKRT" \
        --model "$MODEL" --sizes 512,1024 --steps 1,4 --runs 3
    suite 600 speed --out "$OUT/cpu" --backend cpu --runtime-dir "$CUDA_DIR" --cli "$CLI" \
        --model "$MODEL" --sizes 512 --steps 1 --runs 2 --steady 2
    for f in "$FARM_LOGS"/*.log; do [ -e "$f" ] && { echo "== $f (tail)"; tail -30 "$f"; }; done
}

# After the engine stopped using direct VAE convolution on CUDA: speed against sd-cli and
# peak memory again, on the carried CUDA build.
cuda_recheck() {
    ensure
    suite 200 speed --out "$OUT/cuda" --backend cuda --runtime-dir "$CUDA_DIR" --cli "$CLI" \
        --model "$MODEL" --sizes 512,1024 --steps 1 --runs 3
    suite 60 memory --out "$OUT/cuda" --backend cuda --runtime-dir "$CUDA_DIR" \
        --model "$MODEL" --taesd-model "$TAESD" --sizes 512,1024
}

# CUDA only (no Vulkan carried): the farm against the in-process loop, then speed against
# sd-cli at 1024. Cold, the build (~220 s) comes first; farm and speed share what is left.
cudafarm() {
    ensure
    suite 200 farm --out "$OUT/cuda" --backend cuda --runtime-dir "$CUDA_DIR" \
        --model "$MODEL" --sizes 512 --jobs 200 --batch-count 8 --farm-log-dir "$FARM_LOGS"
    suite 200 speed --out "$OUT/cuda" --backend cuda --runtime-dir "$CUDA_DIR" --cli "$CLI" \
        --model "$MODEL" --sizes 1024 --steps 1 --runs 5
    for f in "$FARM_LOGS"/*.log; do [ -e "$f" ] && { echo "== $f (tail)"; tail -30 "$f"; }; done
}

# The farm's added latency per job against the in-process loop (bench/farm_overhead.py, the
# tiny model) on this 16-core host: on the GPU, then on the CPU alone (no CUDA device seen).
overhead() {
    ensure
    mkdir -p "$OUT/cuda"
    for size in 256 512; do
        say "farm_overhead.py, the full-size model at ${size}x${size} on CUDA0"
        on_cuda 150 -X faulthandler \
            bench/farm_overhead.py --model "$MODEL" --size $size --jobs 100 \
            --out "$OUT/cuda/farm-overhead-$size.json"
    done
}

# Speed against sd-cli at 512 and 1024 with one call of 6 images per fresh process on each
# side (the first image of a fresh process varies by +-10% on both), then the farm overhead
# at 256 with the bare Celery round trip beside it.
speedbatch() {
    ensure
    suite 220 speed --out "$OUT/cuda" --backend cuda --runtime-dir "$CUDA_DIR" --cli "$CLI" \
        --model "$MODEL" --sizes 512,1024 --steps 1 --runs 3 --speed-batch 6
    say "farm_overhead.py, the full-size model at 256x256 on CUDA0"
    on_cuda 150 -X faulthandler \
        bench/farm_overhead.py --model "$MODEL" --size 256 --jobs 100 \
        --out "$OUT/cuda/farm-overhead-256.json"
}

# The GPU-only tests (tests/gpu, skipped elsewhere) on CUDA0: with the tiny model, then with
# the full-size model.
gputests() {
    ensure
    for m in "" "$MODEL"; do
        say "pytest tests/gpu (model: ${m:-tiny})"
        SDFARM_GPU_TEST_MODEL="$m" on_cuda 200 -m pytest tests/gpu -v -rs -p no:cacheprovider \
            2>&1 | tail -25
    done
}

# One 1024x1024 image on the CPU alone (16 cores, CUDA hidden), through the CLI: the CPU
# figure at 1024 that the speed stage's repeated runs would need ~8 minutes for.
cpu1024() {
    ensure
    mkdir -p "$OUT/cpu"
    CUDA_VISIBLE_DEVICES="" on_cuda 400 -m sdfarm.cli.main generate --in-process \
        --model "$MODEL" --device CPU --width 1024 --height 1024 --steps 1 --seed 42 "a lighthouse on a cliff at dusk" \
        -o /tmp/cpu1024.png --json > "$OUT/cpu/cpu-1024.json"
    say "exit $?: $($PY -c "import json; d=json.load(open('$OUT/cpu/cpu-1024.json')); print(d['device'], d['timings'])")"
}

# Two GPUs (an nvidia-h200-x2 machine): figures and choice with GPU 0 held, the warning and
# the refusal sum, a two-model batch on one worker per GPU against one GPU.
twogpu() {
    ensure
    mkdir -p "$OUT/cuda"
    on_cuda 420 bench/two_gpu.py \
        --model "$MODEL" --taesd-model "$TAESD" --jobs ${TWO_GPU_JOBS:-480} --out "$OUT/cuda/two-gpu.json"
    nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv || true
}

# The job schema's further parts on CUDA0 with the full-size model: peak against estimate of
# img2img, inpainting and the hires pass (stage features), then the step caches' speed-up and
# what they change in the image (bench/step_cache.py).
features() {
    ensure
    suite 200 features --out "$OUT/cuda" --backend cuda --runtime-dir "$CUDA_DIR" \
        --model "$MODEL" --sizes 512,1024
    say "step_cache.py, the full-size model at 512x512, 20 steps"
    on_cuda 200 bench/step_cache.py --model "$MODEL" --size 512 --steps 20 --repeat 3 \
        --out "$OUT/cuda/step-cache-512.json"
}

# VAE tiling (bench/vae_tiling.py): peak and time untiled against tiled at 1024, 2048 and
# 4096, then 4096x4096 with vae_tiling auto, which the H200's own figure refuses untiled.
tiling() {
    ensure
    mkdir -p "$OUT/cuda"
    on_cuda 300 bench/vae_tiling.py "$MODEL" --sizes 1024 2048 4096 --modes off on \
        --device cuda --runtime-dir "$CUDA_DIR" --log-level info --timeout 150 --out "$OUT/cuda/vae-tiling.json"
    on_cuda 150 bench/vae_tiling.py "$MODEL" --sizes 4096 --modes auto \
        --device cuda --runtime-dir "$CUDA_DIR" --log-level info --timeout 140 --out "$OUT/cuda/vae-tiling-auto-4096.json"
}

# Images/s per GPU: several engines on the H200 (bench/engines_per_gpu.py), then the peer,
# PyTorch + diffusers with the same architecture (bench/peer_diffusers.py; the diffusers
# wheel carried in .whl), eager, then compiled while the phase's time lasts.
peer() {
    ensure
    mkdir -p "$OUT/cuda"
    say "engines_per_gpu.py at 512, 1 step"
    on_cuda 150 bench/engines_per_gpu.py --model "$MODEL" --engines 1,2,4,8 --size 512 \
        --steps 1 --images 16 --out "$OUT/cuda/engines-per-gpu-512.json"
    say "peer_diffusers.py"
    local left=$(( PHASE_BUDGET - $(now) - 20 ))
    timeout "$left" $PY bench/peer_diffusers.py --sizes 512,1024 --steps 1,4 --batches 1,4 \
        --compile --runs 5 --deadline $(( left - 150 )) --out "$OUT/cuda/peer-diffusers.json"
}

# Both, in one call of the device: tiling first, then what is left for the peer.
tilingpeer() {
    tiling
    peer
}

# stage BUDGET NAME SCRIPT ARGS...: one bench script on the CUDA runtime with --deadline
# min(BUDGET, what is left of the phase - 15 s), killed 10 s after that; skipped (and said)
# when less than 30 s are left. Whatever it wrote before a kill stays in $OUT.
stage() {
    local budget=$1 name=$2; shift 2
    local left=$(( PHASE_BUDGET - $(now) ))
    if [ "$left" -lt 30 ]; then say "SKIPPED (phase budget spent): $name"; return; fi
    local dl=$(( budget < left - 15 ? budget : left - 15 ))
    say "== $name: $* --deadline $dl"
    on_cuda $(( dl + 10 )) "$@" --deadline "$dl"
    say "== $name exited $?"
}

# Issues #12, #14, #15 in one call: where the SD-2 UNet aborts on CUDA (sd-cli children,
# VAE tiling on), the VAE decode options (bench/decode_options.py), GPU efficiency of one
# worker on a 500-job batch (bench/farm_efficiency.py), then the 5,000-job batch with the
# file result store and the tiny model, Redis memory and RSS sampled (bench/batch_file_store.py)
# for whatever time is left. A fresh CUDA build is packed while the first stage runs.
# DRY=1 (with DRY_BACKEND=cpu and a CPU build in $CUDA_JSON) runs it small on a CPU.
decodefarm() {
    PACK_LATER=1 ensure
    mkdir -p "$OUT/cuda"
    local dev=CUDA0 lim=1024,1280,1536,1792,2048 nofa=2048 dsz=512,1024 ej=500 bj=5000 sz=512
    if [ "${DRY:-0}" = 1 ]; then dev=CPU lim=64,128 nofa=128 dsz=64 ej=4 bj=400 sz=64; fi
    stage 55 size-limit bench/cuda_size_limit.py --cli "$CLI" --model "$MODEL" \
        --sizes "$lim" --no-fa-sizes "$nofa" --case-timeout 40 \
        --out "$OUT/cuda/cuda-size-limit.json"
    pack_wait
    stage 95 decode bench/decode_options.py --cli "$CLI" --model "$MODEL" \
        --taesd-model "$TAESD" --sizes "$dsz" --batch 4 --case-timeout 40 \
        --out "$OUT/cuda/cuda-decode.json"
    stage 90 efficiency bench/farm_efficiency.py --model "$MODEL" --device "$dev" --jobs "$ej" \
        --size "$sz" --log-dir "$FARM_LOGS/eff" --out "$OUT/cuda/cuda-efficiency-500.json"
    for f in "$FARM_LOGS"/eff/*.log; do [ -e "$f" ] && { echo "== $f (tail)"; tail -8 "$f"; }; done
    stage 400 batch-file bench/batch_file_store.py --device "$dev" --jobs "$bj" --size "$sz" \
        --log-dir "$FARM_LOGS/batch" --out "$OUT/cuda/cuda-batch-5000-file.json"
    for f in "$FARM_LOGS"/batch/*.log; do [ -e "$f" ] && { echo "== $f (tail)"; tail -8 "$f"; }; done
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true
}

# Issues #14 and #15 with engine slots (sdfarm worker --engines N): the 5,000-job file-store
# batch (tiny model, 4 slots), the farm's images/s per N (full-size model; 512 and 1024, 1 and
# 4 steps), and the GPU's busy fraction over 500 jobs with 2 slots (the union of the slots'
# generations over the worker's makespan). DRY=1 runs it small on a CPU.
lanes() {
    ensure
    mkdir -p "$OUT/cuda"
    local dev=CUDA0 bj=5000 sz=512 big=1024 ej=500 n1=40 n2=16 n4=30
    if [ "${DRY:-0}" = 1 ]; then dev=CPU bj=60 sz=64 big=128 ej=6 n1=4 n2=2 n4=2; fi
    stage 220 batch-file bench/batch_file_store.py --device "$dev" --jobs "$bj" --size "$sz" \
        --engines 4 --log-dir "$FARM_LOGS/batch" --out "$OUT/cuda/cuda-batch-5000-file-4slots.json"
    stage 80 engines-512 bench/farm_engines.py --device "$dev" --model "$MODEL" \
        --engines 1,2,4 --jobs "$n1" --size "$sz" --steps 1 --timeout 120 \
        --out "$OUT/cuda/cuda-farm-engines-512.json"
    stage 80 efficiency-2 bench/farm_efficiency.py --model "$MODEL" --device "$dev" \
        --jobs "$ej" --size "$sz" --engines 2 --log-dir "$FARM_LOGS/eff2" \
        --out "$OUT/cuda/cuda-efficiency-500-2slots.json"
    stage 50 engines-1024 bench/farm_engines.py --device "$dev" --model "$MODEL" \
        --engines 1,2 --jobs "$n2" --size "$big" --steps 1 --timeout 120 \
        --out "$OUT/cuda/cuda-farm-engines-1024.json"
    stage 50 engines-512-4steps bench/farm_engines.py --device "$dev" --model "$MODEL" \
        --engines 1,2 --jobs "$n4" --size "$sz" --steps 4 --timeout 120 \
        --out "$OUT/cuda/cuda-farm-engines-512-4steps.json"
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true
}

# Issues #12 and #15: the GPU peak against the estimate of a video job (the random-weight
# Wan2.1 T2V 1.3B test model, up to Wan's own 480x832x81) and of a ControlNet job (the SD 1.x
# test model and its ControlNet), then the farm's images/s with TAESD as the decoder (the
# full-size model's TAESD variant). DRY=1 runs it small on a CPU.
extras() {
    ensure
    mkdir -p "$OUT/cuda"
    local dev=CUDA0 vc=256x256x17,480x832x17,480x832x33,480x832x81 cs=512,1024 sz=512 big=1024
    local n1=40 n2=16
    if [ "${DRY:-0}" = 1 ]; then dev=cpu vc=32x32x5 cs=64 sz=64 big=128 n1=4 n2=2; fi
    stage 150 video bench/video_memory.py --device "$dev" --cases "$vc" \
        --out "$OUT/cuda/cuda-video-memory.json"
    stage 110 controlnet bench/controlnet_memory.py --device "$dev" --sizes "$cs" \
        --out "$OUT/cuda/cuda-controlnet-memory.json"
    [ "$dev" = cpu ] && dev=CPU
    stage 60 taesd-512 bench/farm_engines.py --device "$dev" --model "$TAESD" --decoder taesd \
        --engines 1,2 --jobs "$n1" --size "$sz" --steps 1 --timeout 120 \
        --out "$OUT/cuda/cuda-farm-engines-taesd-512.json"
    stage 45 taesd-1024 bench/farm_engines.py --device "$dev" --model "$TAESD" --decoder taesd \
        --engines 2 --jobs "$n2" --size "$big" --steps 1 --timeout 120 \
        --out "$OUT/cuda/cuda-farm-engines-taesd-1024.json"
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true
}

# A second CUDA build with one build option changed (GGML_CUDA_GRAPHS, off by default: "use
# CUDA graphs (llama.cpp only)"), in its own cache (the build lock is per cache), started in
# the background at the lowest priority beside the first; variant_wait waits for it.
VARIANT_JSON=/tmp/cuda-build-graphs.json
VARIANT_PID=""
variant_start() {
    [ -s "$VARIANT_JSON" ] && return
    mkdir -p /tmp/sdfcache-graphs/sdist
    cp -n .carry/stable_diffusion_cpp_python-0.4.7.tar.gz /tmp/sdfcache-graphs/sdist/ 2>/dev/null
    say "building the CUDA variant -DGGML_CUDA_GRAPHS=ON in the background"
    ( SDFARM_CACHE=/tmp/sdfcache-graphs nice -n 19 $PY -m sdfarm.native.build --backend cuda \
        --cmake-arg=-DCMAKE_CUDA_ARCHITECTURES=90 --cmake-arg=-DGGML_CUDA_GRAPHS=ON --json \
        > "$VARIANT_JSON.part" 2> /tmp/cuda-build-graphs.err && mv "$VARIANT_JSON.part" "$VARIANT_JSON"
      say "variant build exited $? ($(tail -1 /tmp/cuda-build-graphs.err))" ) &
    VARIANT_PID=$!
}
variant_wait() {
    if [ -n "$VARIANT_PID" ]; then wait "$VARIANT_PID"; VARIANT_PID=""; fi
}

# ggml's CUDA options side by side (bench/build_options.py): the default build; its run-time
# switches (cuBLAS compute type forced to f16 or f32, op fusion off); the CUDA-graphs build,
# alone and with GGML_CUDA_GRAPH_OPT=1 (multi-stream graph optimisation).
build_options() {
    if cuda_built && [ -s "$VARIANT_JSON" ]; then
        CUDA_DIR=$(cuda_field directory)
        local g; g=$($PY -c "import json; print(json.load(open('$VARIANT_JSON'))['directory'])")
        stage 150 build-options bench/build_options.py --model "$MODEL" --device CUDA0 \
            --sizes 512,1024 --images 4 --variant "base=$CUDA_DIR" \
            --variant "cublas-f16=$CUDA_DIR:GGML_CUDA_FORCE_CUBLAS_COMPUTE_16F=1" \
            --variant "cublas-f32=$CUDA_DIR:GGML_CUDA_FORCE_CUBLAS_COMPUTE_32F=1" \
            --variant "no-fusion=$CUDA_DIR:GGML_CUDA_DISABLE_FUSION=1" \
            --variant "graphs=$g" --variant "graphs+opt=$g:GGML_CUDA_GRAPH_OPT=1" \
            --out "$OUT/cuda/cuda-build-options.json"
    else
        say "a CUDA build is missing: build options not measured"
        tail -20 /tmp/cuda-build-graphs.err 2>/dev/null
    fi
}

# The farm at 4 steps on CUDA: 1024 with N = 1, 2 engines; with TAESD (N = 2) at 512 and 1024.
cuda_4steps() {
    stage 60 engines-1024-4steps bench/farm_engines.py --device CUDA0 --model "$MODEL" \
        --engines 1,2 --jobs 12 --size 1024 --steps 4 --timeout 120 \
        --out "$OUT/cuda/cuda-farm-engines-1024-4steps.json"
    for c in "512 30" "1024 12"; do
        set -- $c
        stage 50 "taesd-$1-4steps" bench/farm_engines.py --device CUDA0 --model "$TAESD" \
            --decoder taesd --engines 2 --jobs "$2" --size "$1" --steps 4 --timeout 120 \
            --out "$OUT/cuda/cuda-farm-engines-taesd-$1-4steps.json"
    done
}

# Issues #15 and #12 on CUDA: the default build (and sd-cli) first with every core, the
# CUDA-graphs variant behind it at the lowest priority; while the variant compiles, a LoRA's
# GPU peak against its estimate (bench/lora_memory.py, the rank-64 LoRA of the full-size
# model), the farm at 1024 x 4 steps, and with TAESD at 4 steps; then the options side by side.
cudaopts() {
    prep
    models_start
    variant_start
    NOPACK=1 cuda_ensure
    models_wait
    if ! cuda_built || ! models_ready; then say "no CUDA runtime or models"; exit 3; fi
    CUDA_DIR=$(cuda_field directory)
    mkdir -p "$OUT/cuda"
    stage 70 lora bench/lora_memory.py --model "$MODEL" --lora sd-turbo-lora --device CUDA0 \
        --sizes 512,1024 --out "$OUT/cuda/cuda-lora-memory.json"
    cuda_4steps
    variant_wait
    build_options
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true
}

# The VAE-attention term of the estimate against the GPU (Vulkan draws the UNet at 2048 and
# 4096, CUDA cannot): 2048x2048 untiled and tiled, then 4096x4096 `auto` on the H200's own
# figure, which the untiled estimate (306.8 GiB with the term) now exceeds.
vkcheck() {
    prep
    models_start
    models_wait
    if [ ! -e "$VKRT/build.json" ] || ! models_ready; then say "no Vulkan build or models"; exit 3; fi
    mkdir -p "$OUT/vulkan"
    say "vae_tiling.py ${VKCHECK_SIZES:-2048} ${VKCHECK_MODES:-off on}"
    timeout 200 $PY bench/vae_tiling.py "$MODEL" --sizes ${VKCHECK_SIZES:-2048} \
        --modes ${VKCHECK_MODES:-off on} --device vulkan \
        --runtime-dir "$VKRT" --log-level info --timeout 90 \
        --out "$OUT/vulkan/vae-tiling-2048-attention.json"
    [ -n "${VKCHECK_SIZES:-}" ] && return
    say "vae_tiling.py 4096x4096 auto on the H200's own figure"
    timeout 200 $PY bench/vae_tiling.py "$MODEL" --sizes 4096 --modes auto --device vulkan \
        --runtime-dir "$VKRT" --log-level info --timeout 180 \
        --out "$OUT/vulkan/vae-tiling-4096-auto-h200.json"
}

vulkan_farm() {
    for c in "512 1 40 1,2" "1024 1 16 1,2" "512 4 30 2" "1024 4 12 2"; do
        set -- $c
        STAGE_BACKEND=vulkan STAGE_RUNTIME="$VKRT" stage 50 "vulkan-$1-$2" \
            bench/farm_engines.py --device Vulkan0 --model "$MODEL" --engines "$4" \
            --jobs "$3" --size "$1" --steps "$2" --timeout 120 \
            --out "$OUT/vulkan/vulkan-farm-engines-$1-$2steps.json"
    done
}

# The rest of cudaopts on a machine that still holds both builds: the farm stages, then the
# options again in another order (the first variant of a run was the slowest).
cudamore() {
    ensure
    mkdir -p "$OUT/cuda"
    cuda_4steps
    local g; g=$($PY -c "import json; print(json.load(open('$VARIANT_JSON'))['directory'])")
    stage 150 build-options-2 bench/build_options.py --model "$MODEL" --device CUDA0 \
        --sizes 512,1024 --images 6 --variant "graphs=$g" --variant "cublas-f16=$CUDA_DIR:GGML_CUDA_FORCE_CUBLAS_COMPUTE_16F=1" \
        --variant "base=$CUDA_DIR" --variant "graphs-again=$g" --variant "base-again=$CUDA_DIR" \
        --out "$OUT/cuda/cuda-build-options-2.json"
}

# Issue #15 item 5 and #12's 4096x4096, on the carried Vulkan build (cooperative-matrix
# shaders; .carry/vulkan-runtime.tar.xz, built with Debian 13's glslc: docs/gpu.md); no CUDA.
# 4096x4096: untiled 50.8 GiB by our estimate on Vulkan (direct convolution), tiled 19.3 GiB;
# a 40 GiB figure (an A100-40GB, an L40S) refuses it untiled, so `auto` must tile and say so;
# then untiled on the whole H200, its peak against 50.8 GiB.
vulkan() {
    prep
    models_start
    models_wait
    if [ ! -e "$VKRT/build.json" ] || ! models_ready; then say "no Vulkan build or models"; exit 3; fi
    mkdir -p "$OUT/vulkan"
    suite 50 warmup --out "$OUT/vulkan" --backend vulkan --runtime-dir "$VKRT" \
        --model "$MODEL" --sizes 512 --runs 2
    suite 100 speed --out "$OUT/vulkan" --backend vulkan --runtime-dir "$VKRT" \
        --model "$MODEL" --sizes 512,1024 --steps 1,4 --runs 3
    for m in "auto 40GiB" "off -"; do
        set -- $m
        [ "$1" = off ] && vulkan_farm
        local left=$(( PHASE_BUDGET - $(now) - 10 ))
        if [ "$left" -lt 40 ]; then say "SKIPPED: 4096x4096 --modes $1"; continue; fi
        say "vae_tiling.py 4096x4096 --modes $1 (figure $2) on Vulkan0"
        timeout "$left" $PY bench/vae_tiling.py "$MODEL" --sizes 4096 --modes "$1" \
            $([ "$2" != - ] && echo --figure "$2") --device vulkan --runtime-dir "$VKRT" \
            --log-level info --timeout $(( left > 200 ? 190 : left - 10 )) \
            --out "$OUT/vulkan/vae-tiling-4096-$1.json"
    done
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true
}

# Issue #15's table from one lease, in two calls made back to back (the second finds the
# machine warm: /tmp keeps the build and the models). peerone: the CUDA build (packed into $OUT
# in case the machine goes back before peertwo), then the farm per N at the four cases.
# peertwo: the same cases under CUDA MPS (nvidia-cuda-mps-control, one daemon for the
# host; every engine process becomes its client, so kernels of different engines may run
# at once instead of time-sliced), then the diffusers peer, eager and compiled.
farm_cases() {
    local tag=$1 ns=$2 mult=$3 budget=${4:-70} cases=${5:-"512:1:40 1024:1:16 512:4:30 1024:4:12"}
    for c in $cases; do
        # SIZE:STEPS:JOBS[:IMAGES], IMAGES per job (batch_count, 1 when left out)
        set -- ${c//:/ }
        stage "$budget" "farm-$tag-$1-$2" bench/farm_engines.py --device CUDA0 --model "$MODEL" \
            --engines "$ns" --jobs $(( $3 * mult )) --size "$1" --steps "$2" --batch "${4:-1}" \
            --timeout 120 --out "$OUT/cuda/cuda-farm-engines-$tag-$1-$2steps.json"
    done
}

peerone() {
    ensure
    mkdir -p "$OUT/cuda"
    farm_cases plain 1,2,4 1
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true
}

MPS_DIR=/tmp/mps
mps_start() {
    local ctl; ctl=$(command -v nvidia-cuda-mps-control || ls /usr/local/nvidia/bin/nvidia-cuda-mps-control 2>/dev/null)
    if [ -z "$ctl" ]; then say "MPS: no nvidia-cuda-mps-control on this machine"; return 1; fi
    mkdir -p "$MPS_DIR/pipe" "$MPS_DIR/log"
    export CUDA_MPS_PIPE_DIRECTORY=$MPS_DIR/pipe CUDA_MPS_LOG_DIRECTORY=$MPS_DIR/log
    "$ctl" -d || { say "MPS: the daemon did not start"; return 1; }
    sleep 1
    if timeout 90 $PY -c "import torch; x = torch.ones(4, device='cuda'); print('MPS client ok', float(x.sum()))"; then
        say "MPS: $(pgrep -a nvidia-cuda-mps | tr '\n' ' ')"
        return 0
    fi
    say "MPS: a CUDA client failed under the daemon; its log:"
    tail -20 "$MPS_DIR/log/control.log" "$MPS_DIR/log/server.log" 2>/dev/null
    mps_stop
    return 1
}
mps_stop() {
    echo quit | "$(command -v nvidia-cuda-mps-control || echo /usr/local/nvidia/bin/nvidia-cuda-mps-control)" 2>/dev/null
    sleep 2
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}

# efficiency_by VAR TAG VALUE...: one engine slot's GPU efficiency over 500 jobs of 512x512
# (bench/farm_efficiency.py), once per VALUE of the worker's setting VAR, side by side
# ($OUT/cuda/cuda-efficiency-500-TAGVALUE.json).
efficiency_by() {
    local var=$1 tag=$2; shift 2
    for v in "$@"; do
        ( export "$var=$v"
          stage 90 "efficiency-$tag$v" bench/farm_efficiency.py --model "$MODEL" --device CUDA0 \
              --jobs 500 --size 512 --log-dir "$FARM_LOGS/$tag$v" \
              --out "$OUT/cuda/cuda-efficiency-500-$tag$v.json" )
    done
}

# One engine slot's GPU efficiency over 500 jobs with the worker reserving 1 and then 2
# messages ahead (SDFARM_PREFETCH), side by side; then the MPS probe on a real daemon.
effprefetch() {
    ensure
    mkdir -p "$OUT/cuda"
    efficiency_by SDFARM_PREFETCH prefetch 1 2
    if mps_start; then
        ls -la "$CUDA_MPS_PIPE_DIRECTORY"
        $PY -c "from sdfarm.native.mps import mps_active; print('sdfarm.native.mps.mps_active():', mps_active())"
        mps_stop
        $PY -c "from sdfarm.native.mps import mps_active; print('after quit, with no pipe directory set:', mps_active())"
    fi
}

# What this session's device time did not reach (for the next lease): one slot's GPU
# efficiency over 500 jobs with chained jobs off and on (SDFARM_CHAIN, sdfarm.worker.chain),
# side by side; the image-to-video test model's GPU peak against its estimate (the CLIP vision
# term); the farm with TAESD as the decoder under MPS.
nextlease() {
    chainlease
    i2vmps
}

# One slot's GPU efficiency over 500 jobs with chained jobs off and on, side by side.
chainlease() {
    ensure
    mkdir -p "$OUT/cuda"
    efficiency_by SDFARM_CHAIN chain 0 1
}

# Chained jobs with the lookahead (sdfarm.worker.chain) off and on, 500 jobs each, side by
# side; then on once more (its spread between runs).
lookahead() {
    ensure
    mkdir -p "$OUT/cuda"
    efficiency_by SDFARM_LOOKAHEAD lookahead 0 1
    efficiency_by SDFARM_LOOKAHEAD lookahead-again 1
}

# Where an image's GPU time goes, kernel by kernel (bench/ncu_profile.py: sd-cli under Nsight
# Compute), at 512 and 1024, 1 step. (PyTorch's profiler in our engine's process was tried
# first: torch imported after the runtime's load segfaulted in torch's import, and imported
# before it, with numpy blocked, the load segfaulted: log-lookprofile.txt.)
profile() {
    PACK_LATER=1 ensure
    mkdir -p "$OUT/cuda"
    stage 200 ncu bench/ncu_profile.py --cli "$CLI" --model "$MODEL" --sizes 512,1024 --steps 1 \
        --ncu "$(command -v ncu || echo /usr/local/cuda/bin/ncu)" --out "$OUT/cuda/cuda-ncu-profile.json"
    pack_wait
}

# The lookahead's 500-job runs, then the kernel profiles.
lookprofile() {
    lookahead
    profile
}

# options NAME BUDGET --variant ...: bench/build_options.py at 512 and 1024 (4 timed images per
# variant) into $OUT/cuda/cuda-NAME-options.json.
options() {
    local name=$1 budget=$2; shift 2
    stage "$budget" "$name-options" bench/build_options.py --model "$MODEL" --device CUDA0 \
        --sizes 512,1024 --images 4 "$@" --out "$OUT/cuda/cuda-$name-options.json"
}

# mps_farm TAG BUDGET [CASES] [NS]: the farm with NS engines (4 by default) under MPS at CASES
# (farm_cases's four by default).
mps_farm() {
    if mps_start; then
        farm_cases "$1" "${4:-4}" 2 "$2" "${3:-}"
        mps_stop
    fi
}

# peer_eager NAME STEPS: the peer's eager batch 1 at 512 and 1024 with the call's time left
# (at least 40 s), into $OUT/cuda/cuda-peer-diffusers-NAME.json.
peer_eager() {
    local left=$(( PHASE_BUDGET - $(now) - 5 ))
    if [ "$left" -ge 40 ]; then
        timeout "$left" $PY bench/peer_diffusers.py --sizes 512,1024 --steps "$2" --batches 1 \
            --runs 5 --deadline $(( left - 15 )) --out "$OUT/cuda/cuda-peer-diffusers-$1.json"
    fi
}

# fastest_at_1024 NAME VAR DEFAULT: the value of VAR (DEFAULT where a variant leaves it unset)
# whose variants of cuda-NAME-options.json have the lowest median time at 1024; DEFAULT when
# the file does not read.
fastest_at_1024() {
    $PY -c "
import json, statistics
rows = [r for r in json.load(open('$OUT/cuda/cuda-$1-options.json'))['rows']
        if r.get('size') == 1024]
times = {}
for r in rows:
    times.setdefault(r['env'].get('$2', '$3'), []).append(r['s_per_image'])
print(min(times, key=lambda v: statistics.median(times[v])))" 2>/dev/null || echo "$3"
}

# The tiled im2col (sdfarm.native.sourcepatch) against ggml's kernel in the same build
# (SDFARM_IM2COL_TILED=0), then the farm under MPS (N=4) at 1024 and 512, 1 step, then the
# peer's eager batch 1. (The lease of cuda-im2col2-options.json carried a build that also held
# the first tiled kernel, commit 35e8c5d, as SDFARM_IM2COL_TILED=1: its "tiled1" rows.)
im2col2() {
    NOPACK=1 ensure
    mkdir -p "$OUT/cuda"
    options im2col2 60 --variant "ggml=$CUDA_DIR:SDFARM_IM2COL_TILED=0" \
        --variant "tiled=$CUDA_DIR" --variant "ggml-again=$CUDA_DIR:SDFARM_IM2COL_TILED=0" \
        --variant "tiled-again=$CUDA_DIR"
    mps_farm tiled2-mps 70 "1024:1:16 512:1:40"
    peer_eager im2col2-lease 1
}

# The 4-step cases of the peer table under MPS (N=4) with the carried tiled-im2col runtime.
im2col4() {
    NOPACK=1 ensure
    mkdir -p "$OUT/cuda"
    mps_farm tiled2-mps 70 "1024:4:12 512:4:30"
}

# The split group norm with its affine fused (sdfarm.native.sourcepatch) against ggml's group
# norm, both with the tiled im2col, in one build: ms per image and how far the pixels move
# (the fusion alone off: GGML_CUDA_DISABLE_FUSION=1); then the farm under MPS (N=4) at the
# four cases of the peer table.
gnorm() {
    NOPACK=1 ensure
    mkdir -p "$OUT/cuda"
    options gnorm 100 --variant "ggml-gn=$CUDA_DIR:SDFARM_GROUPNORM_SPLIT=0" \
        --variant "split=$CUDA_DIR" --variant "split-unfused=$CUDA_DIR:GGML_CUDA_DISABLE_FUSION=1" \
        --variant "ggml-gn-again=$CUDA_DIR:SDFARM_GROUPNORM_SPLIT=0" --variant "split-again=$CUDA_DIR"
    mps_farm gnorm-mps 75
}

# The peer of the same lease as gnorm: diffusers eager at batch 1 (four cases), then compiled
# at batch 4 (each shape compiles first, about two minutes at 512), as far as the call allows
# while keeping about 150 s for the kernel profile of a 1024x1024 image with both patches.
gnormpeer() {
    NOPACK=1 ensure
    mkdir -p "$OUT/cuda"
    local left=$(( PHASE_BUDGET - $(now) - 10 ))
    timeout "$left" $PY bench/peer_diffusers.py --sizes 512,1024 --steps 1,4 --batches 1 \
        --compile --compile-batches 4 --runs 5 --deadline $(( left - 210 )) \
        --out "$OUT/cuda/cuda-peer-diffusers-gnorm-lease.json"
    stage 150 ncu bench/ncu_profile.py --cli "$CLI" --model "$MODEL" --sizes 1024 --steps 1 \
        --ncu "$(command -v ncu || echo /usr/local/cuda/bin/ncu)" \
        --out "$OUT/cuda/cuda-ncu-profile-gnorm.json"
}

# The tiled im2col writing 1, 2 or 4 values per store (SDFARM_IM2COL_VEC; a fresh build, made
# here: the sdist carried), side by side in one build; then, with the fastest at 1024, the
# farm under MPS (N=4) at the four cases and the same lease's diffusers eager batch 1.
im2colvec() {
    NOPACK=1 ensure
    mkdir -p "$OUT/cuda"
    options im2colvec 80 --variant "vec1=$CUDA_DIR:SDFARM_IM2COL_VEC=1" \
        --variant "vec2=$CUDA_DIR:SDFARM_IM2COL_VEC=2" --variant "vec4=$CUDA_DIR:SDFARM_IM2COL_VEC=4" \
        --variant "vec1-again=$CUDA_DIR:SDFARM_IM2COL_VEC=1" \
        --variant "vec4-again=$CUDA_DIR:SDFARM_IM2COL_VEC=4"
    local best
    best=$(fastest_at_1024 im2colvec SDFARM_IM2COL_VEC 4)
    say "the farm with SDFARM_IM2COL_VEC=$best (the fastest at 1024)"
    export SDFARM_IM2COL_VEC=$best
    mps_farm vec-mps 60
    peer_eager vec-lease 1,4
}

# With the runtime as it now is (both patches, 4-value im2col; built here): one slot's GPU
# efficiency over 500 jobs of 512x512 (images are about 45% shorter than when it was last
# measured, so the same gap between jobs weighs more), then the farm at 1024 under MPS with
# N = 4 and 8 and four times the jobs of the peer table's run.
vecmore() {
    NOPACK=1 ensure
    mkdir -p "$OUT/cuda"
    efficiency_by SDFARM_LOOKAHEAD patched 1
    if mps_start; then
        farm_cases vec-mps-n48 4,8 4 120 "1024:1:16"
        mps_stop
    fi
}

# The next job claimed ahead, its engine checks done ahead, its result built on the uploader
# thread and the helper threads held off while the job thread starts a native call
# (sdfarm.worker.chain, sdfarm.native.gate; built here: the sdist carried): one slot's GPU
# efficiency over 500 jobs of 512x512 with the lookahead on, off, on again.
effahead() {
    NOPACK=1 ensure
    mkdir -p "$OUT/cuda"
    efficiency_by SDFARM_LOOKAHEAD ahead 1 0
    efficiency_by SDFARM_LOOKAHEAD ahead-again 1
}

# effahead again after the scheduler's change that followed it: a job claimed ahead no longer
# fills its device's backlog (sdfarm.scheduler.registry), so the next message is in the queue
# before the job claimed ahead begins. One slot, 500 jobs of 512x512, twice (EFF_TAG names
# the files: backlog, then wake for the run with the claim's wake-up and the longer chains).
effbacklog() {
    NOPACK=1 ensure
    mkdir -p "$OUT/cuda"
    local tag=${EFF_TAG:-backlog}
    efficiency_by SDFARM_LOOKAHEAD "$tag" 1
    efficiency_by SDFARM_LOOKAHEAD "$tag-again" 1
}

# Right after effahead (the same build): cuBLAS writing f32 straight from its f16 GEMMs
# (GGML_CUDA_FORCE_CUBLAS_COMPUTE_32F=1: no f16 -> f32 conversion kernel after each) against
# the default, side by side; the farm under MPS (N=4) with the faster at 1024; the same
# lease's diffusers eager batch 1.
cublas32() {
    NOPACK=1 ensure
    mkdir -p "$OUT/cuda"
    options cublas32 90 --variant "f16out=$CUDA_DIR" \
        --variant "f32out=$CUDA_DIR:GGML_CUDA_FORCE_CUBLAS_COMPUTE_32F=1" \
        --variant "f16out-again=$CUDA_DIR" \
        --variant "f32out-again=$CUDA_DIR:GGML_CUDA_FORCE_CUBLAS_COMPUTE_32F=1"
    local faster
    faster=$(fastest_at_1024 cublas32 GGML_CUDA_FORCE_CUBLAS_COMPUTE_32F 0)
    if [ "$faster" = 1 ]; then
        say "the farm with GGML_CUDA_FORCE_CUBLAS_COMPUTE_32F=1 (faster at 1024)"
        export GGML_CUDA_FORCE_CUBLAS_COMPUTE_32F=1
    fi
    mps_farm "cublas32-$faster-mps" 60
    peer_eager cublas32-lease 1,4
}

# The cuDNN 9 of the machine's PyTorch (its nvidia-cudnn wheel), for SDFARM_CUDNN.
torch_cudnn() {
    $PY -c "import nvidia.cudnn as m; print(list(m.__path__)[0] + '/lib/libcudnn.so.9')" 2>/dev/null
}

# Why a process convolving through cuDNN ends (2026-12-02: signal 11, nothing on stderr): one
# 512x512 image in build_options.py's child with SDFARM_CUDNN_TRACE=1 (every cuDNN step, and a
# native backtrace on the crash) and Python's fault handler.
cudnndebug() {
    NOPACK=1 ensure
    local lib; lib=$(torch_cudnn)
    say "== one image with cuDNN ($lib), traced"
    SDFARM_CUDNN="$lib" SDFARM_CUDNN_TRACE=1 PYTHONFAULTHANDLER=1 SDFARM_RUNTIME_DIR="$CUDA_DIR" \
        timeout 100 $PY bench/build_options.py --child --model "$MODEL" --device CUDA0 --sizes 512 \
        --images 1 --save /tmp/dbg 2>&1 | tail -60
    say "== exit ${PIPESTATUS[0]}"
}

# Convolutions through cuDNN (native/patches/conv2d_cudnn.cuh, experimental; the machine's
# PyTorch's cuDNN 9 named in SDFARM_CUDNN) against im2col in one build (built here): ms/image,
# pixels, the process's GPU memory against its estimate, with cuDNN's heuristics and with
# implicit-precomputed GEMM alone (SDFARM_CUDNN_ALGO=1); the farm under MPS (N=4) at the
# peer table's four cases with the fastest at 1024; the same lease's diffusers eager batch 1.
cudnnall() {
    NOPACK=1 ensure
    mkdir -p "$OUT/cuda"
    local lib; lib=$(torch_cudnn)
    say "cuDNN: $lib"
    options cudnn 110 --variant "im2col=$CUDA_DIR" --variant "cudnn=$CUDA_DIR:SDFARM_CUDNN=$lib" \
        --variant "cudnn-algo1=$CUDA_DIR:SDFARM_CUDNN=$lib,SDFARM_CUDNN_ALGO=1" \
        --variant "im2col-again=$CUDA_DIR" --variant "cudnn-again=$CUDA_DIR:SDFARM_CUDNN=$lib"
    local pick
    pick=$(fastest_env_at_1024 cudnn)
    say "the farm with the fastest at 1024: '${pick:-no setting}'"
    # shellcheck disable=SC2086
    [ -n "$pick" ] && export $pick
    mps_farm "cudnn-mps" 60
    peer_eager cudnn-lease 1,4
}

# fastest_env_at_1024 NAME: the settings (KEY=VALUE ...) of the variants of
# cuda-NAME-options.json with the lowest median time at 1024 (nothing for none).
fastest_env_at_1024() {
    $PY -c "
import json, statistics
rows = [r for r in json.load(open('$OUT/cuda/cuda-$1-options.json'))['rows']
        if r.get('size') == 1024]
times = {}
for r in rows:
    times.setdefault(json.dumps(r['env'], sort_keys=True), []).append(r['s_per_image'])
best = json.loads(min(times, key=lambda k: statistics.median(times[k])))
print(' '.join(f'{k}={v}' for k, v in best.items()))" 2>/dev/null
}

# cuDNN alone, no build needed (bench/cudnn_check.cpp): the shapes where the runtime's process
# crashed, with the heuristics' algorithm and with IMPLICIT_PRECOMP_GEMM (ALGO=1), plain and
# under Python's LC_CTYPE; CHECKS="A;B" runs those settings instead (@SYSLT@ names the CUDA
# toolkit's cuBLASLt, which the runtime's process has loaded before cuDNN opens its own; @RT@
# the runtime's library, from a carried build, for PRELOAD). PYTHON=1 runs the check inside
# Python (bench/cudnn_check_in_python.py), ENGINE=1 after one image of a CUDA engine of ours
# on the carried build: the next two checks, not yet run.
cudnnalone() {
    prep
    local lib; lib=$(torch_cudnn)
    g++ -O1 -Wno-deprecated-declarations -I/usr/local/cuda/include bench/cudnn_check.cpp \
        -o /tmp/cudnn_check -L/usr/local/cuda/lib64 -lcudart -ldl || return
    if [ ! -e "$CUDART/libstable-diffusion.so" ] && ls "$CUDA_TAR".part-* >/dev/null 2>&1; then
        mkdir -p "$CUDART" && cat "$CUDA_TAR".part-* | tar xJf - -C "$CUDART"
    fi
    ls -l /usr/local/cuda/lib64/libcublasLt.so* "$(dirname "$lib")"/../../cu13/lib/libcublasLt.so* 2>&1
    local sys_lt=/usr/local/cuda/lib64/libcublasLt.so.13 checks e
    IFS=';' read -ra checks <<< "${CHECKS:-;ALGO=1;LOCALE=C.UTF-8}"
    for e in "${checks[@]}"; do
        e=${e//@SYSLT@/$sys_lt}
        e=${e//@RT@/$CUDART/libstable-diffusion.so}
        say "== cudnn_check $e"
        if [[ " $e " == *" PYTHON=1 "* ]]; then
            [ -e /tmp/cudnn_check.so ] || g++ -O1 -shared -fPIC -DCUDNN_CHECK_LIBRARY \
                -Wno-deprecated-declarations -I/usr/local/cuda/include bench/cudnn_check.cpp \
                -o /tmp/cudnn_check.so -L/usr/local/cuda/lib64 -lcudart -ldl
            env $e SDFARM_BACKEND=cuda SDFARM_RUNTIME_DIR="$CUDART" timeout 120 \
                $PY bench/cudnn_check_in_python.py /tmp/cudnn_check.so "$lib" 2>&1 |
                grep -v "^cudnn[A-Z]" | tail -16
        else
            env $e timeout 60 /tmp/cudnn_check "$lib" 2>&1 | grep -v "^cudnn[A-Z]" | tail -16
        fi
        say "exit ${PIPESTATUS[0]}"
    done
}

# sdpa: a build with attention through cuDNN (native/patches/fattn_cudnn.cuh; the headers come
# from the carried nvidia-cudnn-frontend wheel, PyTorch's cuDNN wheel and the toolkit), one
# traced image, cuDNN's attention against ggml's in the same build (ms, pixels), then the farm
# with it under MPS at the peer table's cases, and the peer's eager batch 1 of this lease.
sdpa() {
    PACK_LATER=1 ensure
    mkdir -p "$OUT/cuda"
    local lib; lib=$(torch_cudnn)
    say "attention through cuDNN compiled in (build.log lines): $(grep -c 'SDFARM_CUDNN_SDPA=1' "$CUDA_DIR/build.log")"
    grep -o 'CMAKE_CUDA_FLAGS=[^$]*' "$CUDA_DIR/build.log" | head -1 | cut -c1-400
    say "== one image through cuDNN ($lib)"
    SDFARM_CUDNN="$lib" SDFARM_RUNTIME_DIR="$CUDA_DIR" timeout 90 \
        $PY bench/build_options.py --child --model "$MODEL" --device CUDA0 --sizes 512 --images 1 \
        --save /tmp/sdpa > /tmp/sdpa.txt 2>&1
    say "== exit $?"
    grep -i "sdfarm:\|@@build\|signal\|refused\|error" /tmp/sdpa.txt | head -20
    options sdpa 150 --variant "sdpa=$CUDA_DIR:SDFARM_CUDNN=$lib" \
        --variant "ggml-attn=$CUDA_DIR:SDFARM_CUDNN=$lib,SDFARM_CUDNN_SDPA=0" \
        --variant "sdpa-again=$CUDA_DIR:SDFARM_CUDNN=$lib" \
        --variant "ggml-attn-again=$CUDA_DIR:SDFARM_CUDNN=$lib,SDFARM_CUDNN_SDPA=0"
    pack_wait
    export SDFARM_CUDNN="$lib"
    if mps_start; then
        farm_cases sdpa-mps 4 2 70
        mps_stop
    fi
    peer_eager sdpa-farm-lease 1,4
}

sdpapeer() {
    ensure_cudnn
    local lib=$SDFARM_CUDNN
    options sdpa4 100 --sizes 1024 --steps 4 --variant "sdpa=$CUDA_DIR:SDFARM_CUDNN=$lib" \
        --variant "ggml-attn=$CUDA_DIR:SDFARM_CUDNN=$lib,SDFARM_CUDNN_SDPA=0" \
        --variant "sdpa-again=$CUDA_DIR:SDFARM_CUDNN=$lib" \
        --variant "ggml-attn-again=$CUDA_DIR:SDFARM_CUDNN=$lib,SDFARM_CUDNN_SDPA=0"
    if mps_start; then
        farm_cases sdpa-mps-b 4 2 70 "1024:4:12 1024:1:16"
        farm_cases sdpa-mps-n8 8 2 80 "1024:4:12 1024:1:16"
        mps_stop
    fi
    peer_eager sdpa-lease 1,4
    peer_compiled 1024 200 compiled-1024
}

# peer_compiled SIZE SECONDS NAME: the peer's eager batch 1 and compiled batch 4 at SIZE (1 and
# 4 steps; its compile takes about 100 s) into cuda-peer-diffusers-NAME.json, when at least
# SECONDS of the phase are left.
peer_compiled() {
    local left=$(( PHASE_BUDGET - $(now) - 5 ))
    if [ "$left" -lt "$2" ]; then say "SKIPPED: compiled batch 4 at $1 (${left}s left)"; return; fi
    timeout "$left" $PY bench/peer_diffusers.py --sizes "$1" --steps 1,4 --batches 1 --compile \
        --compile-batches 4 --runs 5 --deadline $(( left - 10 )) \
        --out "$OUT/cuda/cuda-peer-diffusers-$3.json"
}

sdpatable() {
    ensure_cudnn
    if mps_start; then
        farm_cases sdpa-mps-n8all 8 2 70
        mps_stop
    fi
    peer_eager sdpa-table-lease 1,4
    peer_compiled 512 150 compiled-512-sdpa-lease
}

# fuse: build here (our six CUDA patches: the linear and layer-norm fusions are new) and pack it
# to carry; one engine with and without the fusions at 512 and 1024 x 4 steps (SDFARM_CUDNN on;
# fresh processes alternating; pixels compared); the farm under MPS at N = 8 at the 4-step
# cases with them.
FUSE_OFF="SDFARM_LINEAR_FUSED=0,SDFARM_LAYER_NORM_FUSED=0"
fuse() {
    PACK_LATER=1 ensure_cudnn
    local base="$CUDA_DIR:SDFARM_CUDNN=$SDFARM_CUDNN"
    say "attention through cuDNN compiled in (build.log lines): $(grep -c 'SDFARM_CUDNN_SDPA=1' "$CUDA_DIR/build.log")"
    options fuse4 170 --steps 4 --images 3 --variant "fused=$base" \
        --variant "unfused=$base,$FUSE_OFF" --variant "linear-only=$base,SDFARM_LAYER_NORM_FUSED=0" \
        --variant "fused-again=$base" --variant "unfused-again=$base,$FUSE_OFF"
    pack_wait
    if mps_start; then
        farm_cases fuse-mps-n8 8 2 80 "1024:4:12 512:4:30"
        mps_stop
    fi
}

# fusetable: fuse's build (carried or still here): the farm under MPS at N = 8 at the four
# cases; the peer's eager batch 1 and compiled batch 4 at 512.
fusetable() {
    ensure_cudnn
    if mps_start; then
        farm_cases fuse-mps-n8all 8 2 70
        mps_stop
    fi
    peer_eager fuse-table-lease 1,4
    peer_compiled 512 150 compiled-512-fuse-lease
}

# fusepeer: right after fusetable: the peer's compiled batch 4 at 1024, its eager batch 1 again,
# and the farm's 4-step cases at N = 8 again.
fusepeer() {
    ensure_cudnn
    peer_compiled 1024 200 compiled-1024-fuse-lease
    peer_eager fuse-peer-lease 1,4
    if mps_start; then
        farm_cases fuse-mps-n8b 8 2 70 "1024:4:12 512:4:30"
        mps_stop
    fi
}

# fusemore: fuse's build carried: one engine with and without the fusions at 1024 x 4 steps
# (nothing else on the machine; alternating), then the farm under MPS at N = 1, 2, 4 at 1024 x 4
# steps (N = 8: fusetable, fusepeer).
fusemore() {
    ensure_cudnn
    local base="$CUDA_DIR:SDFARM_CUDNN=$SDFARM_CUDNN"
    options fuse1024 150 --sizes 1024 --steps 4 --images 4 --variant "fused=$base" \
        --variant "unfused=$base,$FUSE_OFF" --variant "fused-again=$base" \
        --variant "unfused-again=$base,$FUSE_OFF"
    if mps_start; then
        farm_cases fuse-mps-curve 1,2,4 2 200 "1024:4:12"
        mps_stop
    fi
}

# attnfuse: build here (the self-attention fusion added: native/patches/attn_fused.cuh), packed
# in the background; one engine with all fusions and without the attention's, at 512 and 1024 x
# 4 steps (pixels compared); then the farm under MPS at N = 8 at the 4-step cases, with the
# attention fusion only where the A/B found the same pixels and a faster image at both sizes.
attnfuse() {
    PACK_LATER=1 ensure_cudnn
    attn_ab attn4 110 ,SDFARM_ATTN_FUSED=1 fused no-attn --images 3
    pack_wait
    attn_verdict "$OUT/cuda/cuda-attn4-options.json"
    if mps_start; then
        farm_cases attn-mps-n8 8 2 60 "512:4:30 1024:4:12"
        mps_stop
    fi
}

# attn_ab NAME BUDGET ON ON_NAME OFF_NAME ARGS...: one engine with the self-attention fusion
# (SDFARM_CUDNN and ON added to the environment) and with SDFARM_ATTN_FUSED=0, twice each,
# alternating, at 4 steps (options' sizes unless ARGS name them) into cuda-NAME-options.json.
attn_ab() {
    local name=$1 budget=$2 on=$3 yes=$4 no=$5; shift 5
    local base="$CUDA_DIR:SDFARM_CUDNN=$SDFARM_CUDNN" off=",SDFARM_ATTN_FUSED=0"
    options "$name" "$budget" --steps 4 "$@" --variant "$yes=$base$on" --variant "$no=$base$off" \
        --variant "$yes-again=$base$on" --variant "$no-again=$base$off"
}

# attn_verdict OPTIONS_JSON: export SDFARM_ATTN_FUSED=1 when the A/B in OPTIONS_JSON has the
# attention fusion's image identical to the one without it and faster at every size, else 0.
attn_verdict() {
    SDFARM_ATTN_FUSED=$($PY - "$1" <<'PY'
import json, statistics, sys
try:
    rows = json.load(open(sys.argv[1]))["rows"]
except (OSError, ValueError, KeyError):
    print(0)
    sys.exit()
ok = bool(rows)
for size in sorted({r.get("size") for r in rows}):
    at = [r for r in rows if r.get("size") == size]
    ms = {k: [r["s_per_image"] * 1000 for r in at if r["variant"].startswith(k) and "s_per_image" in r]
          for k in ("fused", "no-attn")}
    same = len({r.get("pixels") for r in at}) == 1 and all(ms.values())
    faster = same and statistics.mean(ms["fused"]) < statistics.mean(ms["no-attn"])
    print(f"{size}: same pixels {same}; ms/image {ms}", file=sys.stderr)
    ok = ok and faster
print(int(ok))
PY
)
    export SDFARM_ATTN_FUSED
    say "the attention fusion in the farm: SDFARM_ATTN_FUSED=$SDFARM_ATTN_FUSED"
}

# attntable: attnfuse's build (still here, or carried): the farm under MPS at N = 8 at the four
# cases (the attention fusion as attnfuse's A/B decided, ATTN_AB naming it when it came back).
attntable() {
    ensure_cudnn
    attn_verdict "${ATTN_AB:-$OUT/cuda/cuda-attn4-options.json}"
    if mps_start; then
        farm_cases "attn-mps-n8${ATTN_TAG:-all}" 8 2 60 "${ATTN_CASES:-512:1:40 1024:1:16 512:4:30 1024:4:12}"
        mps_stop
    fi
}

# attnpeer: right after attntable, in the same lease (no runtime needed, so it carries the
# diffusers wheel instead): the peer's eager batch 1, then compiled batch 4 at 512 and at 1024.
attnpeer() {
    prep
    mkdir -p "$OUT/cuda"
    peer_eager attn-peer-lease 1,4
    peer_compiled 512 150 compiled-512-attn-lease
    peer_compiled 1024 200 compiled-1024-attn-lease
}

# attndefault: build here with the attention fusion on by default (not packed); one engine
# with the default and with SDFARM_ATTN_FUSED=0 at 512 and 1024 x 4 steps (pixels compared);
# the farm under MPS at 512 x 4 steps with N = 8 and 12.
attndefault() {
    NOPACK=1 ensure_cudnn
    attn_ab attndefault 80 "" default attn-off --images 3
    if mps_start; then
        farm_cases attn-default 8,12 2 100 "512:4:30"
        mps_stop
    fi
}

BATCH_FOUR="512:4:12:4 512:1:16:4 1024:4:8:4 1024:1:8:4"  # the four cases, 4-image jobs

# batch: build here (not packed), with a job's images sampled together
# (native/patches/batch_sample.hpp); one engine making jobs of 4 images, sampled together and
# one by one (SDFARM_BATCH_SAMPLING=0), alternating, and together with the transformer fusions
# off (their batched path must give ggml's pixels), at 512 and 1024 x 4 steps: ms per image,
# the pixels, the process's GPU peak; then the farm under MPS (N = 8) with 4-image jobs at the
# peer table's four cases (BATCH_CASES).
batch() {
    NOPACK=1 ensure_cudnn
    local base="$CUDA_DIR:SDFARM_CUDNN=$SDFARM_CUDNN" off=",SDFARM_BATCH_SAMPLING=0"
    local unfused=",SDFARM_ATTN_FUSED=0,SDFARM_LINEAR_FUSED=0,SDFARM_LAYER_NORM_FUSED=0"
    options batch4 160 --steps 4 --batch 4 --images 2 --variant "together=$base" \
        --variant "one-by-one=$base$off" --variant "together-again=$base" \
        --variant "one-by-one-again=$base$off" --variant "together-unfused=$base$unfused"
    mps_farm batch-mps-n8 70 "${BATCH_CASES:-$BATCH_FOUR}" 8
}

# batchtable: batch's build, still here: the farm under MPS with 4-image jobs at N = BATCH_NS
# (8) at the four cases (BATCH_CASES), then the peer's eager batch 1 at 512 and 1024.
batchtable() {
    ensure_cudnn
    mps_farm "batch-mps-table${BATCH_TAG:-}" "${BATCH_STAGE:-70}" "${BATCH_CASES:-$BATCH_FOUR}" \
        "${BATCH_NS:-8}"
    peer_eager batch-lease 1,4
}

# batchpeer: right after batchtable (no runtime needed): the peer's compiled batch 4 at 512,
# then at 1024.
batchpeer() {
    prep
    mkdir -p "$OUT/cuda"
    case " ${PEER_SIZES:-512 1024} " in *" 512 "*) peer_compiled 512 150 compiled-512-batch-lease ;; esac
    case " ${PEER_SIZES:-512 1024} " in *" 1024 "*) peer_compiled 1024 200 compiled-1024-batch-lease ;; esac
}

# batchbig: build here (not packed); the largest batches a farm sends on both CUDA paths
# (cuDNN's, and im2col's without SDFARM_CUDNN): 4 images at 1984x1984 and 8 at 1024x1024, 1
# step, each job checked for all its images (a process the runtime aborts says so).
batchbig() {
    NOPACK=1 ensure_cudnn
    local base="$CUDA_DIR:SDFARM_CUDNN=$SDFARM_CUDNN"
    options batchbig4 200 --sizes 1984 --steps 1 --batch 4 --images 1 \
        --variant "cudnn=$base" --variant "im2col=$CUDA_DIR"
    options batchbig8 150 --sizes 1024 --steps 1 --batch 8 --images 1 \
        --variant "cudnn=$base" --variant "im2col=$CUDA_DIR"
}

# attnquick: attnfuse's first half for a short lease: build here (not packed), then one engine
# with and without the self-attention fusion at 1024 x 4 steps, pixels compared.
attnquick() {
    NOPACK=1 ensure_cudnn
    attn_ab attnq 80 ,SDFARM_ATTN_FUSED=1 fused no-attn --sizes 1024 --images 2
}

# moreengines: fuse's build carried: the farm under MPS at N = 8, 12, 16 at 512 x 4 and 1 step
# (past the 8 measured so far; the scheduler still counts every engine and job).
moreengines() {
    ensure_cudnn
    if mps_start; then
        farm_cases fuse-mps-n81216 8,12,16 2 110 "512:4:30 512:1:40"
        mps_stop
    fi
}

# fattn: ggml's flash-attention op alone at the SD UNet's shapes (bench/fattn_bench.cpp),
# ggml's configuration and FA_VARIANTS of its head-size-64 row (bench/fattn_variants.py),
# alternating, each output compared with ggml's own; then PyTorch's SDPA at the same shapes.
# Needs the carried sdist (its vendored ggml); builds ggml alone (about 3 minutes).
FA_VARIANTS=${FA_VARIANTS:-"b128=128,2,128,2 w256=256,1,128,2 w256o2=256,2,64,2 o3=128,3,64,2 w256b64=256,1,64,2"}
fattn() {
    prep
    local base=/tmp/fa b=/tmp/fa/build g lib log="$OUT/fattn.jsonl"
    g=$(ls -d $base/stable_diffusion_cpp_python-*/vendor/stable-diffusion.cpp/ggml 2>/dev/null)
    if [ -z "$g" ] || ! ls "$b"/bin/libggml-cuda.so* >/dev/null 2>&1; then
        rm -rf "$base" && mkdir -p "$base"
        tar xzf .carry/stable_diffusion_cpp_python-0.4.7.tar.gz -C "$base" || return
        g=$(ls -d $base/stable_diffusion_cpp_python-*/vendor/stable-diffusion.cpp/ggml)
        $PY bench/fattn_variants.py patch "$g" || return
        say "building ggml (CUDA, sm_90) alone"
        cmake -S "$g" -B "$b" -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
            -DCMAKE_BUILD_TYPE=Release -DGGML_BUILD_TESTS=OFF -DGGML_BUILD_EXAMPLES=OFF \
            -DCMAKE_EXPORT_COMPILE_COMMANDS=ON -DCMAKE_SKIP_BUILD_RPATH=ON -DCMAKE_RUNTIME_OUTPUT_DIRECTORY="$b/bin" \
            -DCMAKE_LIBRARY_OUTPUT_DIRECTORY="$b/bin" > "$base/cmake.log" 2>&1 || { tail -30 "$base/cmake.log"; return; }
        cmake --build "$b" -j"$(nproc)" --target ggml > "$base/build.log" 2>&1 || { tail -40 "$base/build.log"; return; }
        say "built"
    fi
    lib="$b/bin"
    g++ -O2 -std=c++17 bench/fattn_bench.cpp -I"$g/include" -L"$lib" -lggml -lggml-base -lggml-cuda \
        -o "$base/fattn_bench" || return
    say "variants: $FA_VARIANTS"
    # shellcheck disable=SC2086
    $PY bench/fattn_variants.py build "$b" $FA_VARIANTS
    say "built the variants"
    local order=(base) v dir
    for v in $FA_VARIANTS; do order+=("${v%%=*}"); done
    order+=(base2)
    for v in "${order[@]}"; do
        dir="$lib"
        [ -d "$b/fa-variants/$v" ] && dir="$b/fa-variants/$v:$lib"
        say "== $v"
        LD_LIBRARY_PATH="$dir" timeout 120 "$base/fattn_bench" 50 "$base/$v.bin" |
            sed "s/^{/{\"variant\": \"$v\", /" | tee -a "$log" | grep -E '16384|per UNet'
    done
    $PY - "$base" "${order[@]}" <<'PYEOF' | tee -a "$log"
import array, json, sys
base = sys.argv[1]
ref = array.array("f"); ref.frombytes(open(f"{base}/base.bin", "rb").read())
for v in sys.argv[2:]:
    try:
        got = array.array("f"); got.frombytes(open(f"{base}/{v}.bin", "rb").read())
    except OSError:
        continue
    diff = max(abs(a - b) for a, b in zip(ref, got)) if len(got) == len(ref) else None
    print(json.dumps({"variant": v, "compare": "self 16384 x 5 heads against ggml's",
                      "values": len(got), "max_abs_diff": diff}))
PYEOF
    say "== torch SDPA"
    timeout 120 $PY bench/fattn_torch.py 50 | sed 's/^{/{"variant": "torch", /' | tee -a "$log" |
        grep -E '16384|per UNet'
}

# exporters FILE: the libraries FILE lists (one a line) that define any of libstdc++'s
# locale/ostream symbols besides libstdc++ itself: what could answer cuDNN's calls instead.
exporters() {
    local so n
    while read -r so; do
        [ -e "$so" ] && [[ "$so" != *libstdc++* ]] || continue
        n=$(nm -D --defined-only "$so" 2>/dev/null | grep -c ' _ZNSt6locale\| _ZNSo9_M_insert\| _ZNSt9basic_ios')
        [ "$n" -gt 0 ] && say "  $so defines $n of libstdc++'s locale/ostream symbols"
    done < "$1"
    say "  (of $(wc -l < "$1") libraries mapped)"
}

# Why the runtime's process crashed in cuDNN (docs/gpu.md, "Convolutions through cuDNN"): the
# check inside Python (plain, libstdc++ opened RTLD_GLOBAL first, libstdc++ preloaded) while
# the CUDA runtime builds; then beside a CUDA engine; then one traced image of the real patch
# per setting; the first setting that makes an image is measured against im2col (ms, pixels,
# GPU memory). The build is packed to carry next time.
cudnnwhy() {
    prep
    mkdir -p "$OUT/cuda"
    models_start
    local lib; lib=$(torch_cudnn)
    say "cuDNN: $lib; building the CUDA runtime in the background"
    ( NOPACK=1 cuda_ensure ) > /tmp/cuda-build.log 2>&1 &
    local bpid=$! stdcxx=/lib/x86_64-linux-gnu/libstdc++.so.6
    CHECKS="PYTHON=1 MAPS=/tmp/maps-python.txt;PYTHON=1 STDCXX_GLOBAL=1;PYTHON=1 LD_PRELOAD=$stdcxx" cudnnalone
    [ -e /tmp/maps-python.txt ] && exporters /tmp/maps-python.txt
    wait "$bpid"
    tail -3 /tmp/cuda-build.log
    cuda_built || { say "no CUDA runtime: stopping here"; return; }
    CUDA_DIR=$(cuda_field directory)
    CUDART=$CUDA_DIR
    PACK_NICE="nice -n 19" pack_cuda > /tmp/pack.log 2>&1 &
    CHECKS="PYTHON=1 ENGINE=1 MAPS=/tmp/maps-engine.txt" cudnnalone
    [ -e /tmp/maps-engine.txt ] && exporters /tmp/maps-engine.txt
    models_wait
    local v works=""
    # (log-cudnnwhy.txt also tried SDFARM_CUDNN_STDCXX=1, a patch switch that made libstdc++
    # global before cuDNN opened: it crashed the same, and the switch is gone.)
    for v in "SDFARM_CUDNN_TRACE=1" "LD_PRELOAD=$stdcxx" \
            "SDFARM_GROUPNORM_SPLIT=0 SDFARM_IM2COL_TILED=0"; do
        say "== one traced image with cuDNN: $v"
        # shellcheck disable=SC2086
        env $v SDFARM_CUDNN="$lib" SDFARM_CUDNN_TRACE=1 SDFARM_RUNTIME_DIR="$CUDA_DIR" timeout 60 \
            $PY bench/build_options.py --child --model "$MODEL" --device CUDA0 --sizes 512 --images 1 \
            --save /tmp/why > /tmp/why.txt 2>&1
        local rc=$?
        grep -v "sdfarm cudnn: mapped\|sdfarm cudnn: plan\|sdfarm cudnn: forward\|sdfarm cudnn: algo" /tmp/why.txt |
            tail -12
        say "== exit $rc"
        if grep -q "sdfarm cudnn: mapped" /tmp/why.txt; then
            sed -n 's/^sdfarm cudnn: mapped //p' /tmp/why.txt > /tmp/maps-crash.txt
            exporters /tmp/maps-crash.txt
        fi
        [ $rc -eq 0 ] && [ -z "$works" ] && works=$v
    done
    wait
    tail -2 /tmp/pack.log
    if [ -n "$works" ]; then
        local env=${works// /,}
        [ "$env" = SDFARM_CUDNN_TRACE=1 ] && env=""
        say "measuring cuDNN with '$env' against im2col"
        options cudnn 150 --variant "im2col=$CUDA_DIR" --variant "cudnn=$CUDA_DIR:SDFARM_CUDNN=$lib${env:+,$env}" \
            --variant "cudnn-algo1=$CUDA_DIR:SDFARM_CUDNN=$lib,SDFARM_CUDNN_ALGO=1${env:+,$env}" \
            --variant "im2col-again=$CUDA_DIR" --variant "cudnn-again=$CUDA_DIR:SDFARM_CUDNN=$lib${env:+,$env}"
    fi
}

# After the fixes cudnnwhy pointed to (the runtime keeps a static libstdc++ private:
# native/build.py PRIVATE_STDCXX; cuDNN's workspace capped by the tensors, not at 64 MiB):
# build here; the libstdc++ symbols the runtime still defines; one traced image through cuDNN
# with nothing preloaded; cuDNN (heuristics; cudnnFind) against im2col: ms, pixels; the peak
# GPU memory through cuDNN against its estimate. The build is packed to carry next time.
cudnnfix() {
    PACK_LATER=1 ensure
    mkdir -p "$OUT/cuda"
    local lib so; lib=$(torch_cudnn)
    so=$CUDA_DIR/libstable-diffusion.so
    say "libstdc++'s locale/ostream symbols the runtime defines:" \
        "$(nm -D --defined-only "$so" | grep -c ' _ZNSt6locale\| _ZNSo9_M_insert\| _ZNSt9basic_ios')," \
        "GNU-unique symbols: $(nm -D --defined-only "$so" | grep -c ' u ')," \
        "libstdc++ needed: $(readelf -d "$so" | grep -c 'libstdc++')"
    say "== one traced image through cuDNN ($lib), nothing preloaded"
    SDFARM_CUDNN="$lib" SDFARM_CUDNN_TRACE=1 SDFARM_RUNTIME_DIR="$CUDA_DIR" timeout 60 \
        $PY bench/build_options.py --child --model "$MODEL" --device CUDA0 --sizes 512 --images 1 \
        --save /tmp/fix > /tmp/fix.txt 2>&1
    say "== exit $?"
    grep "sdfarm cudnn: plan\|chose\|@@build\|signal\|refused" /tmp/fix.txt | head -70
    options cudnnfix 170 --variant "im2col=$CUDA_DIR" --variant "cudnn=$CUDA_DIR:SDFARM_CUDNN=$lib" \
        --variant "cudnn-find=$CUDA_DIR:SDFARM_CUDNN=$lib,SDFARM_CUDNN_FIND=1" \
        --variant "im2col-again=$CUDA_DIR" --variant "cudnn-again=$CUDA_DIR:SDFARM_CUDNN=$lib"
    ( export SDFARM_CUDNN="$lib"; suite 60 memory --out "$OUT/cuda-cudnn" --backend cuda \
        --runtime-dir "$CUDA_DIR" --model "$MODEL" --sizes 512,1024 )
    pack_wait
}

# ensure, and the machine's PyTorch's cuDNN named to every process started after (SDFARM_CUDNN).
ensure_cudnn() {
    ensure
    mkdir -p "$OUT/cuda"
    SDFARM_CUDNN=$(torch_cudnn)
    export SDFARM_CUDNN
    say "cuDNN: $SDFARM_CUDNN"
}

# The peer table with convolutions through cuDNN (the build cudnnfix packed, carried): the
# farm under MPS at N = 4 at the four cases, N = 2 and 8 at 1024 x 1 step, then the same
# lease's diffusers eager batch 1.
cudnnfarm() {
    ensure_cudnn
    if mps_start; then
        farm_cases cudnn-mps 4 2 70
        farm_cases cudnn-mps-n28 2,8 2 90 "1024:1:16"
        mps_stop
    fi
    peer_eager cudnn-farm-lease 1,4
}

# cudnnfarm's 4-step cases at N = 8 (1024 x 4 steps was 0.97x the peer's eager batch 1 at
# N = 4), then the same lease's eager batch 1 at 4 steps.
cudnnn8() {
    ensure_cudnn
    if mps_start; then
        farm_cases cudnn-mps-n8 8 2 80 "1024:4:12 512:4:30"
        mps_stop
    fi
    peer_eager cudnn-n8-lease 4
}

# The decode table with direct convolution through cuDNN (SDFARM_CUDNN named; sd-cli's default
# case keeps im2col), on the build cudnnfix packed.
cudnndecode() {
    ensure_cudnn
    stage 110 decode-cudnn bench/decode_options.py --cli "$CLI" --model "$MODEL" \
        --taesd-model "$TAESD" --sizes 512,1024 --batch 4 --case-timeout 40 \
        --out "$OUT/cuda/cuda-decode-options-cudnn.json"
}

# The peer at 512 only, eager batch 1 and compiled batch 4 (compiling for 1024 takes 5 minutes
# more): the compiled column of the cuDNN lease's table.
peer512c() {
    prep
    mkdir -p "$OUT/cuda"
    local left=$(( PHASE_BUDGET - $(now) - 5 ))
    timeout "$left" $PY bench/peer_diffusers.py --sizes 512 --steps 1,4 --batches 1 --compile \
        --compile-batches 4 --runs 5 --deadline $(( left - 10 )) \
        --out "$OUT/cuda/cuda-peer-diffusers-compiled-512.json"
}

# The image-to-video test model's GPU peak against its estimate; TAESD under MPS at N = 2, 4.
i2vmps() {
    PACK_LATER=1 ensure
    mkdir -p "$OUT/cuda"
    stage 120 video-i2v bench/video_memory.py --device CUDA0 --variant i2v \
        --cases 256x256x17,480x832x17 --out "$OUT/cuda/cuda-video-memory-i2v.json"
    pack_wait
    if mps_start; then
        for c in "512 40" "1024 16"; do
            set -- $c
            stage 80 "mps-taesd-$1" bench/farm_engines.py --device CUDA0 --model "$TAESD" \
                --decoder taesd --engines 2,4 --jobs $(( $2 * 2 )) --size "$1" --steps 1 \
                --timeout 120 --out "$OUT/cuda/cuda-farm-engines-mps-taesd-$1.json"
        done
        mps_stop
    fi
}

# The engines-per-GPU curve under MPS past N=2 (peertwo's stages ran out of time there).
peerthree() {
    ensure
    mkdir -p "$OUT/cuda"
    mps_start || return
    farm_cases mps-n48 4,8 2 150 "512:1:40 1024:1:16 512:4:30"
    farm_cases mps-n24 2,4 2 100 "1024:4:12"
    mps_stop
}

peertwo() {
    ensure
    mkdir -p "$OUT/cuda"
    if mps_start; then
        farm_cases mps 1,2,4,8 2
        tail -5 "$MPS_DIR/log/control.log" 2>/dev/null
        mps_stop
    fi
    local left=$(( PHASE_BUDGET - $(now) - 15 ))
    if [ "$left" -lt 60 ]; then say "SKIPPED: the peer"; return; fi
    say "peer_diffusers.py (eager, then compiled batch 4) with ${left}s"
    timeout "$left" $PY bench/peer_diffusers.py --sizes 512,1024 --steps 1,4 --batches 1,4 \
        --compile --runs 5 --deadline $(( left - 20 )) --out "$OUT/cuda/cuda-peer-diffusers-same-lease.json"
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true
}

case "$PHASE" in
    setup | bench1 | bench2) ;;
    cuda_recheck | cudafarm | overhead | speedbatch | gputests | cpu1024 | twogpu) ;;
    features | tiling | peer | tilingpeer | decodefarm | lanes | extras | cudaopts | cudamore | vulkan | vkcheck | peerone | peertwo | peerthree | effprefetch | nextlease | chainlease | i2vmps | lookahead | profile | lookprofile | im2col2 | im2col4 | gnorm | gnormpeer | im2colvec | vecmore | effahead | cublas32 | effbacklog | cudnndebug | cudnnall | cudnnalone | cudnnwhy | cudnnfix | cudnnfarm | cudnnn8 | cudnndecode | peer512c | fattn | sdpa | sdpapeer | sdpatable | fuse | fusetable | fusepeer | fusemore | attnfuse | attntable | attnpeer | attndefault | attnquick | moreengines | batch | batchtable | batchpeer | batchbig) ;;
    *) echo "usage: bash bench/gpu_run.sh setup|bench1|bench2|cuda_recheck|cudafarm|overhead|speedbatch|gputests|cpu1024|twogpu|features|tiling|peer|tilingpeer|decodefarm|lanes|extras|cudaopts|cudamore|vulkan|vkcheck|peerone|peertwo|peerthree|effprefetch|nextlease|chainlease|i2vmps|lookahead|profile" >&2; exit 2 ;;
esac
set -o pipefail
mkdir -p "$OUT"
"$PHASE" 2>&1 | tee "$OUT/log-$PHASE.txt"
rc=$?
# At most 8 files come back: past that, the JSON of $OUT/*/ travel as one tar.
if [ "$(find "$OUT" -type f | wc -l)" -gt 8 ]; then
    for d in "$OUT"/*/; do
        [ -d "$d" ] && tar -C "$OUT" -czf "$OUT/$(basename "$d")-results.tar.gz" "$(basename "$d")" &&
            rm -rf "$d"
    done
fi
echo "[$(now)s] phase $PHASE done (exit $rc); results under $OUT"
exit $rc
