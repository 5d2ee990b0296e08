"""bench/gpu_suite (the package), the pure parts: sd-cli log parsing, medians and ratios, the
farm's efficiency arithmetic, the deadline, the case lists and the sd-cli command line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

from gpu_suite import analysis, children, cli, harness, holder, stage_speed  # noqa: E402

# Lines as sd-cli -v prints them (master-596), progress bar and all.
SD_CLI_LOG = """\
[INFO ] stable-diffusion.cpp:815  - Version: SD 2.x
[INFO ] model.cpp:993  - loading tensors completed, taking 0.42s (process: 0.00s, read: 0.31s, \
memcpy: 0.00s, convert: 0.02s, copy_to_backend: 0.08s)
[INFO ] stable-diffusion.cpp:3367 - generate_image 512x512
[INFO ] stable-diffusion.cpp:3168 - get_learned_condition completed, taking 0.02s
  |==================================================| 1/1 - 9.18it/s\r
[INFO ] stable-diffusion.cpp:3190 - sampling completed, taking 0.11s
[INFO ] stable-diffusion.cpp:3208 - latent 1 decoded, taking 0.15s
[INFO ] stable-diffusion.cpp:3591 - generate_image completed in 0.29s
[INFO ] main.cpp:420  - save result image 0 to 'out.png' (success)
"""


def test_parse_generate_seconds_from_sd_cli_log():
    assert analysis.parse_generate_seconds(SD_CLI_LOG) == pytest.approx(0.29)


def test_parse_generate_seconds_takes_the_last_and_handles_absence():
    text = "generate_image completed in 1.50s\n...\ngenerate_image completed in 12.07s\n"
    assert analysis.parse_generate_seconds(text) == pytest.approx(12.07)
    assert analysis.parse_generate_seconds("generate_image 512x512\nno timing here") is None
    assert analysis.parse_generate_seconds("") is None
    # Not fooled by the video variant.
    assert analysis.parse_generate_seconds("generate_video completed in 3.00s") is None


def test_parse_generate_seconds_from_our_records():
    # Our engine's records carry the runtime's message with a prefix.
    text = "stable_diffusion: generate_image completed in 0.31s"
    assert analysis.parse_generate_seconds(text) == pytest.approx(0.31)


def test_parse_phase_seconds():
    phases = analysis.parse_phase_seconds(SD_CLI_LOG)
    assert phases["loading tensors"] == pytest.approx(0.42)
    assert phases["get_learned_condition"] == pytest.approx(0.02)
    assert phases["sampling"] == pytest.approx(0.11)
    assert phases["generate_image"] == pytest.approx(0.29)


def test_median_ignores_missing_values():
    assert analysis.median([0.3, None, 0.1, 0.2]) == pytest.approx(0.2)
    assert analysis.median([0.4, 0.2]) == pytest.approx(0.3)
    assert analysis.median([]) is None
    assert analysis.median([None]) is None


def test_ratio_and_tolerance():
    assert analysis.ratio(0.306, 0.30) == pytest.approx(1.02)
    assert analysis.within(analysis.ratio(0.306, 0.30), 0.02) is True
    assert analysis.within(analysis.ratio(0.307, 0.30), 0.02) is False
    assert analysis.within(analysis.ratio(0.25, 0.30), 0.02) is True  # faster is always fine
    assert analysis.ratio(None, 0.3) is None
    assert analysis.ratio(0.3, 0.0) is None
    assert analysis.within(None, 0.02) is None


def test_gpu_efficiency():
    # 200 jobs of 0.29 s on one worker in 60 s: 58 / 60.
    assert analysis.gpu_efficiency([0.29] * 200, 1, 60.0) == pytest.approx(58 / 60)
    assert analysis.gpu_efficiency([0.29] * 200, 2, 30.0) == pytest.approx(58 / 60)
    assert analysis.gpu_efficiency([1.0], 0, 10.0) is None
    assert analysis.gpu_efficiency([1.0], 1, 0.0) is None


def test_per_second_and_added_per_job():
    assert analysis.per_second(8, 2.0) == pytest.approx(4.0)
    assert analysis.per_second(8, 0) is None
    assert analysis.per_second(8, None) is None
    assert analysis.added_per_job(62.0, 60.0, 200) == pytest.approx(0.01)
    assert analysis.added_per_job(62.0, 60.0, 0) is None


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_deadline_expires_and_caps_child_timeouts():
    clock = Clock()
    d = harness.Deadline(100.0, clock=clock)
    assert not d.expired()
    assert d.remaining() == pytest.approx(100.0)
    assert d.child_timeout(300.0, grace=45.0) == pytest.approx(145.0)
    assert d.child_timeout(60.0, grace=45.0) == pytest.approx(60.0)
    clock.t += 90.0
    assert d.child_timeout(300.0, grace=45.0) == pytest.approx(55.0)
    clock.t += 10.0
    assert d.expired()
    clock.t += 500.0
    assert d.child_timeout(300.0, grace=45.0, floor=20.0) == pytest.approx(20.0)


def test_no_deadline_never_expires():
    clock = Clock()
    d = harness.Deadline(None, clock=clock)
    clock.t += 1e9
    assert not d.expired()
    assert d.remaining() is None
    assert d.child_timeout(300.0) == 300.0


def test_stage_skips_cases_past_the_deadline(tmp_path):
    clock = Clock()
    d = harness.Deadline(10.0, clock=clock)
    args = cli.build_parser().parse_args(["speed", "--out", str(tmp_path), "--backend", "cpu"])
    st = harness.Stage("speed", args, d, [harness.Runtime.make("cpu", None)])
    ran = []
    st.case("first", lambda: ran.append(1) or {"x": 1})
    st.case("broken", lambda: 1 / 0)
    clock.t += 11.0
    st.case("late", lambda: ran.append(2) or {})
    assert ran == [1]
    doc = st.doc
    assert [c["case"] for c in doc["cases"]] == ["first", "broken"]
    assert doc["cases"][0]["ok"] and doc["cases"][0]["x"] == 1
    assert not doc["cases"][1]["ok"] and "ZeroDivisionError" in doc["cases"][1]["error"]
    assert doc["skipped"] == [{"case": "late", "reason": "deadline"}]
    assert (tmp_path / "gpu-speed.json").exists()


def test_sizes_steps_and_cases():
    assert analysis.parse_sizes("512,1024") == [(512, 512), (1024, 1024)]
    assert analysis.parse_sizes("512x768, 64") == [(512, 768), (64, 64)]
    with pytest.raises(ValueError):
        analysis.parse_sizes(" , ")
    cases = analysis.speed_cases(analysis.parse_sizes("512,1024"), [1, 4])
    assert cases == [(512, 512, 1), (1024, 1024, 1), (512, 512, 4)]
    assert analysis.speed_cases([(64, 64)], [1]) == [(64, 64, 1)]


def test_sd_cli_command_mirrors_the_engine():
    files = {"checkpoint": "/m/model.safetensors"}
    cmd = stage_speed.sd_cli_command("/b/sd-cli", files, 512, 512, 4, 42, "a cat", 16, "/o/x.png")
    assert cmd[:3] == ["/b/sd-cli", "--model", "/m/model.safetensors"]
    joined = " ".join(cmd)
    for part in (
        "-W 512",
        "-H 512",
        "--steps 4",
        "--seed 42",
        "--cfg-scale 1.0",
        "-t 16",
        "--diffusion-fa",
        "--vae-conv-direct",
        "-o /o/x.png",
    ):
        assert part in joined
    assert cmd[-1] == "-v"
    assert cmd[cmd.index("-p") + 1] == "a cat"
    taesd = {"diffusion_model": "/m/d", "llm": "/m/l", "taesd": "/m/t"}
    cmd = stage_speed.sd_cli_command("sd-cli", taesd, 64, 64, 1, 1, "p", 2, "o.png", batch_count=8)
    assert "--vae-conv-direct" not in cmd
    assert cmd[1:7] == ["--diffusion-model", "/m/d", "--llm", "/m/l", "--taesd", "/m/t"]
    assert cmd[cmd.index("--batch-count") + 1] == "8"


def test_huge_apparent_bytes_exceeds_gpu_plus_memavailable():
    gib = 1 << 30
    n = analysis.huge_apparent_bytes([140 * gib], 120 * gib)
    assert n * 1.25 > 260 * gib
    assert n % 256 == 0
    assert analysis.huge_apparent_bytes([], None) >= 200 * 10**9


def test_above_estimate():
    rows = [
        {"case": "a", "estimate": 100, "peak_rss": 90, "gpu_peak": 120},
        {"case": "b", "estimate": 100, "peak_rss": None, "gpu_peak": 100},
        {"case": "c", "estimate": None, "peak_rss": 500},
    ]
    over = analysis.above_estimate(rows, ("peak_rss", "gpu_peak"))
    assert over == [
        {"case": "a", "measure": "gpu_peak", "value": 120, "estimate": 100, "ratio": 1.2}
    ]


def test_holder_split():
    assert holder.holder_split("held 1024 512 4096") == {
        "held": 1024,
        "free_after": 512,
        "total": 4096,
    }
    assert holder.holder_split("warming up") is None


def test_runtime_env_for_cpu_hides_gpus_of_a_gpu_build(tmp_path):
    (tmp_path / "build.json").write_text('{"backend": "cuda"}')
    rt = harness.Runtime.make("cpu", str(tmp_path))
    env = rt.env({"PATH": "/bin"})
    assert env["SDFARM_BACKEND"] == "cuda"
    assert env["SDFARM_RUNTIME_DIR"] == str(tmp_path.resolve())
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["GGML_VK_VISIBLE_DEVICES"] == ""
    assert rt.device == "cpu" and rt.worker_device == "CPU"
    vk = harness.Runtime.make("vulkan", None).env({})
    assert vk["SDFARM_BACKEND"] == "vulkan" and "SDFARM_RUNTIME_DIR" not in vk
    assert "CUDA_VISIBLE_DEVICES" not in vk
    assert harness.Runtime.make("cuda", None).worker_device == "CUDA0"


def test_merge_parts_keeps_what_a_crashed_child_reported():
    m = children.MARK
    lines = [
        "noise the runtime printed",
        m + '{"pid": 7, "load_s": 1.5, "capabilities": {"device": "CUDA0"}}',
        m + '{"gen": {"generate_s": 0.3}}',
        "stable_diffusion: more noise",
        m + '{"gen": {"generate_s": 0.29}}',
    ]
    doc = children.merge_parts(lines)
    assert doc["load_s"] == 1.5 and doc["capabilities"]["device"] == "CUDA0"
    assert [g["generate_s"] for g in doc["gens"]] == [0.3, 0.29]
    assert "disposed" not in doc
    done = children.merge_parts(
        [
            *lines,
            m + '{"stage": "generations", "gens_wall_s": 0.6, "peak_rss": 9}',
            m + '{"disposed": true}',
        ]
    )
    assert done["disposed"] is True and done["gens_wall_s"] == 0.6 and "stage" not in done
    assert children.merge_parts(["nothing reported"]) is None


def test_child_status():
    assert analysis.child_status({"returncode": 0, "disposed": True}) == {
        "returncode": 0,
        "disposed": True,
    }
    crashed = analysis.child_status(
        {"returncode": -6, "stderr_tail": "corrupted double-linked list"}
    )
    assert crashed["crashed"] and "corrupted" in crashed["stderr_tail"]


def test_compare_with_smi():
    mib = 1 << 20
    reports = {
        "vulkan": {
            "devices": [
                {"name": "Vulkan0", "type": "gpu", "free": 143139 * mib, "total": 143771 * mib},
                {"name": "CPU", "type": "cpu", "free": 1, "total": 1},
            ]
        },
        "cuda": {
            "devices": [
                {"name": "CUDA0", "type": "gpu", "free": 142000 * mib, "total": 143155 * mib}
            ]
        },
    }
    smi = [
        {
            "index": 0,
            "name": "NVIDIA H200",
            "total_mib": 143771,
            "used_mib": 0,
            "free_mib": 143150,
            "driver": "x",
        }
    ]
    out = analysis.compare_with_smi(reports, smi)
    assert out["vulkan"] == [
        {
            "name": "Vulkan0",
            "smi_index": 0,
            "ggml_free_mib": 143139,
            "ggml_total_mib": 143771,
            "smi_free_mib": 143150,
            "smi_total_mib": 143771,
            "free_diff_mib": -11,
            "total_diff_mib": 0,
        }
    ]
    assert out["cuda"][0]["total_diff_mib"] == 143155 - 143771
    assert analysis.compare_with_smi(reports, "nvidia-smi not found") == {}


def test_load_summary_checks_the_one_warning():
    from sdfarm.native.devices import Device
    from sdfarm.native.memory import warning_message

    dev = Device(0, "Vulkan0", "NVIDIA H200", "gpu", 1_500_000_000, 150_000_000_000)
    estimate = 3_795_000_000
    msg = "sdfarm: " + warning_message(estimate, dev, dev.free)
    res = {
        "returncode": 0,
        "disposed": True,
        "load_s": 2.0,
        "capabilities": {
            "device": "Vulkan0",
            "memory_check": "warn",
            "estimate": estimate,
            "figures": {"Vulkan0 (NVIDIA H200)": dev.free, "MemAvailable": 10**11},
            "fit_plan": {"summary": "Vulkan0: diffusion offloaded, text_encoders cpu, vae gpu"},
        },
        "load_records": [
            {"seq": 0, "level": "warn", "message": msg, "source": "engine"},
            {"seq": 0, "level": "info", "message": "sdfarm: fit plan: ...", "source": "engine"},
            {
                "seq": 5,
                "level": "warn",
                "message": "stable_diffusion: unknown tensor",
                "source": "sd",
            },
        ],
        "gens": [{"generate_s": 1.2}],
    }
    s = analysis.load_summary(res, "vulkan")
    assert s["memory_check"] == "warn" and s["warn_records"] == 1
    assert s["warning_names_device"] and s["warning_names_estimate"] and s["warning_names_figure"]
    assert s["runtime_warn_records"] == 1 and s["returncode"] == 0
    # A warning that names other numbers is caught.
    res["load_records"][0]["message"] = "sdfarm: " + warning_message(estimate, dev, 42)
    assert analysis.load_summary(res, "vulkan")["warning_names_figure"] is False
    refused = analysis.load_summary(
        {"returncode": 0, "error": {"type": "ModelTooLargeError"}}, "cuda"
    )
    assert refused["error"]["type"] == "ModelTooLargeError" and refused["warn_records"] == 0


def test_pixel_diff(tmp_path):
    from PIL import Image

    a, b, c = tmp_path / "a.png", tmp_path / "b.png", tmp_path / "c.png"
    Image.new("RGB", (8, 8), (10, 20, 30)).save(a)
    Image.new("RGB", (8, 8), (10, 20, 30)).save(b)
    assert stage_speed.pixel_diff(a, b) == 0
    img = Image.new("RGB", (8, 8), (10, 20, 30))
    img.putpixel((3, 3), (10, 27, 30))
    img.save(b)
    assert stage_speed.pixel_diff(a, b) == 7
    Image.new("RGB", (4, 4)).save(c)
    assert stage_speed.pixel_diff(a, c) is None
    assert stage_speed.pixel_diff(a, tmp_path / "missing.png") is None
