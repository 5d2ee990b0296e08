"""The Lua scripts of the farm (`store/lua/*.lua`), read once per process and registered once per
connection.

Every state change of a job is one script: Redis runs it atomically, so two parties racing
for a job (a worker's finish and the scheduler's requeue, a cancel and a placement) can never
interleave. `prelude.lua` holds the helpers the scripts share and is put in front of each,
after the metrics constants (`sdfarm.store.metrics.lua_constants`) and WEBHOOKS_CAP.
"""

from __future__ import annotations

from functools import cache
from importlib.resources import files
from typing import Any

from sdfarm.store.keys import WEBHOOKS_CAP
from sdfarm.store.metrics import lua_constants

NAMES = (
    "submit",
    "cancel",
    "place",
    "fail",
    "requeue",
    "overdue",
    "forget",
    "drop_stale",
    "snapshot",
    "claim",
    "claim_ahead",
    "start",
    "unclaim",
    "restore_held",
    "loaded",
    "progress",
    "preview",
    "event",
    "finish",
    "lease_renew",
    "lease_release",
    "webhook_take",
    "webhook_settle",
    "results_reserve",
    "results_release",
    "delete",
)


@cache
def source(name: str) -> str:
    """The script `name` with the metrics constants and the prelude in front."""
    lua = files("sdfarm.store") / "lua"
    prelude = (lua / "prelude.lua").read_text()
    constants = lua_constants() + f"local WEBHOOKS_CAP = {WEBHOOKS_CAP}\n"
    return constants + prelude + "\n" + (lua / f"{name}.lua").read_text()


def register(client: Any) -> dict[str, Any]:
    """{name: script} registered on one redis-py client (EVALSHA, loaded on first use)."""
    return {name: client.register_script(source(name)) for name in NAMES}
