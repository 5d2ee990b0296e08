"""A local farm's /metrics ports: consecutive from a base, schedulers first, each child given
its own on loopback; the environment's single port never reaches the children (two
schedulers and several workers share the host)."""

from __future__ import annotations

from pathlib import Path

from sdfarm.localfarm.farm import LocalFarm


def test_each_child_gets_its_own_port_and_the_environments_is_dropped(tmp_path: Path) -> None:
    env = {"SDFARM_WORKER_METRICS_PORT": "9102", "SDFARM_SCHEDULER_METRICS_PORT": "9101"}
    farm = LocalFarm([tmp_path], devices=["CPU", "Vulkan0"], announce=False, schedulers=2,
                     env=env, metrics_port=9500)  # fmt: skip
    assert farm.metrics_ports() == {
        "scheduler": 9500,
        "scheduler:2": 9501,
        "worker:CPU": 9502,
        "worker:Vulkan0": 9503,
    }
    cmd = farm._worker_command("Vulkan0")
    assert cmd[cmd.index("--metrics-port") + 1] == "9503"
    assert cmd[cmd.index("--metrics-addr") + 1] == "127.0.0.1"
    assert not set(env) & set(farm.env)


def test_without_a_base_no_child_serves_metrics(tmp_path: Path) -> None:
    farm = LocalFarm([tmp_path], devices=["CPU"], announce=False,
                     env={"SDFARM_WORKER_METRICS_PORT": "9102"})  # fmt: skip
    assert farm.metrics_ports() == {}
    assert "--metrics-port" not in farm._worker_command("CPU")
    assert "SDFARM_WORKER_METRICS_PORT" not in farm.env
