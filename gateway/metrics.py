"""The Prometheus text of `GET /metrics`: jobs by state (`Store.count_by_state`), and queue
depth, pending jobs, devices and running jobs (`Farm.status`). Gauges only: everything is
read from the farm on each scrape, the gateway counts nothing itself.
"""

from __future__ import annotations

from sdfarm.client.farm import Farm
from sdfarm.store import STATES


def prometheus_text(farm: Farm) -> str:
    """Jobs by state (the job records the farm holds: live ones and those finished within the
    result TTL), queue depth by priority, devices known and alive, jobs running."""
    counts = farm.store.count_by_state()
    status = farm.status()
    lines = [
        "# HELP sdfarm_jobs Jobs Redis holds a record of, by state.",
        "# TYPE sdfarm_jobs gauge",
        *(f'sdfarm_jobs{{state="{s}"}} {counts.get(s, 0)}' for s in STATES),
        "# HELP sdfarm_queue_depth Jobs waiting for placement, by priority.",
        "# TYPE sdfarm_queue_depth gauge",
        *(f'sdfarm_queue_depth{{priority="{p}"}} {n}' for p, n in status["queues"].items()),
        "# HELP sdfarm_queue_pending Jobs waiting for placement (the queue limit counts these).",
        "# TYPE sdfarm_queue_pending gauge",
        f"sdfarm_queue_pending {status['pending']}",
        "# HELP sdfarm_devices Devices known to the farm.",
        "# TYPE sdfarm_devices gauge",
        f"sdfarm_devices {len(status['devices'])}",
        "# HELP sdfarm_devices_alive Devices with a live heartbeat.",
        "# TYPE sdfarm_devices_alive gauge",
        f"sdfarm_devices_alive {sum(1 for d in status['devices'] if d.get('alive'))}",
        "# HELP sdfarm_jobs_running Jobs placed or running on a device.",
        "# TYPE sdfarm_jobs_running gauge",
        f"sdfarm_jobs_running {len(status['running'])}",
    ]
    return "\n".join(lines) + "\n"
