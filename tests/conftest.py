"""Shared fixtures: a real redis-server on a free port and the tiny test model.

Nothing here imports the farm modules (worker, scheduler service, client) at import time, so
unit tests run while those are being written and a broken farm module fails only its tests.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

# The runtime's threads (OpenMP: libgomp) wait at each of a graph's barriers by spinning
# before they sleep. The tests run in two processes on CI's 2 cores, where a 2-thread engine
# beside another spins on the core the other one needs: two processes making the MoE test
# video side by side took 7.5-20 s each with the default wait, 5.2-6.5 s with passive waiting,
# one alone about 3 s either way (2-core VM). Set before any engine loads (libgomp reads it
# once, when it loads), so the in-process engines and the workers, CLIs and children the tests
# start all have it; a value already in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

HEAVY_FIRST = (
    "tests/e2e/test_chaos.py",
    "tests/e2e/test_crasher_sweep.py",
    "tests/e2e/test_video_farm.py",
    "tests/e2e/test_video_moe.py",
    "tests/e2e/test_video_images.py",
    "tests/e2e/test_video.py",
    "tests/e2e/test_video_doors.py",
    "tests/e2e/test_controlnet.py",
    "tests/e2e/test_vae_tiling.py",
    "tests/e2e/test_controlnet_farm.py",
    "tests/integration/test_sentinel.py",
    "tests/e2e/test_job_schema.py",
    "tests/integration/test_gateway_waiters.py",
    "tests/integration/test_worker.py",
    "tests/e2e/test_batch.py",
)
"""The longest test files (CI's --durations), run first. `./dev test` gives each of two
processes whole files in the order collected (pytest-xdist --dist loadfile): with the longest
ones last, one process ran a 4-minute file alone at the end while the other core idled."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The HEAVY_FIRST files' tests before the rest, each file's own order kept."""
    root = Path(str(config.rootpath))

    def rank(item: pytest.Item) -> int:
        rel = Path(str(item.path)).relative_to(root).as_posix()
        return HEAVY_FIRST.index(rel) if rel in HEAVY_FIRST else len(HEAVY_FIRST)

    items.sort(key=rank)  # stable: within a rank, collection order


@pytest.fixture(scope="session")
def redis_server() -> Iterator[object]:
    """One private redis-server for the whole session (starting one per test costs ~50 ms
    and a port each); `redis_url` empties it before every test."""
    from sdfarm.localfarm.redis_server import RedisServer

    server = RedisServer.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server) -> str:
    """The session server's URL, FLUSHALLed first so no test sees another's keys."""
    import redis

    client = redis.Redis.from_url(redis_server.url)
    try:
        client.flushall()
    finally:
        client.close()
    return redis_server.url


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """[dir/tiny-f16, dir/tiny-q8_0]: the tiny random-weight model the runtime really loads,
    written once per session."""
    from sdfarm.native.testmodel import make_test_model

    return make_test_model(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def sd1_dir() -> Path:
    """A models directory with the random-weight SD 1.x model `sd1-tiny` (q4_0), its
    ControlNet `controlnets/sd1-control` and embeddings `embeddings/sd1-emb*`: the tiny model
    takes neither ControlNet nor embeddings. Written once into ~/.cache/sdfarm/testmodels
    (about 14 s, 2 GB) and reused by every later session and CI run that keeps that cache."""
    from sdfarm.native.sd1model import ensure_sd1_test_model

    return ensure_sd1_test_model()


@pytest.fixture(scope="session")
def models_dir(tiny_models: list[Path]) -> Path:
    """The directory holding both tiny models (what `--models DIR` takes)."""
    return tiny_models[0].parent


@pytest.fixture(scope="session")
def wan_model() -> Path:
    """The random-weight Wan2.1 T2V 1.3B test model's folder (sdfarm.native.wantestmodel),
    written once into the runtime's cache (about 1 GB, 14 s) and reused by later sessions."""
    from sdfarm.native.wantestmodel import cached_wan_test_model

    return cached_wan_test_model()


@pytest.fixture(scope="session")
def vace_model(wan_model: Path) -> Path:
    """The VACE variant of the Wan test model (one VACE block: it reads an init image as its
    reference), beside it in the cache (0.8 GB more, the VAE shared)."""
    from sdfarm.native.wantestmodel import VACE_NAME, cached_wan_test_model

    return cached_wan_test_model(VACE_NAME)


@pytest.fixture(scope="session")
def i2v_model(wan_model: Path) -> Path:
    """The image-to-video variant of the Wan test model: a Wan2.1 I2V DiT at the 1.3B width
    (img_emb, in_dim 36) with a CLIP vision encoder (OpenCLIP ViT-H/14, q4_0) beside it in the
    cache (1.25 GB more, about 12 s; the VAE hard-linked)."""
    from sdfarm.native.wantestmodel import I2V_NAME, cached_wan_test_model

    return cached_wan_test_model(I2V_NAME)


@pytest.fixture(scope="session")
def moe_model(wan_model: Path) -> Path:
    """The Wan 2.2-style MoE pair of the test model: its T2V DiT as the low-noise expert and
    another of the same architecture as the high_noise_diffusion_model, beside it in the cache
    (0.8 GB more, about 7 s; the T2V DiT and the VAE hard-linked)."""
    from sdfarm.native.wantestmodel import MOE_NAME, cached_wan_test_model

    return cached_wan_test_model(MOE_NAME)
