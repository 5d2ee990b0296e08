"""sdfarm.store: the farm's Redis contract. Every key name (`keys`), every record (`records`),
every Lua script (`lua/`, registered by `scripts`) and Celery's wire format (`transport`) live
here, behind `Store`'s named transitions; no other module names a key or runs a script.
"""

from sdfarm.store.records import FINAL_STATES, STATES, Claim, JobResult, JobSpec
from sdfarm.store.store import NOT_LEADER, FarmReading, Placement, QuotaExceededError, Store

__all__ = [
    "FINAL_STATES",
    "NOT_LEADER",
    "STATES",
    "Claim",
    "FarmReading",
    "JobResult",
    "JobSpec",
    "Placement",
    "QuotaExceededError",
    "Store",
]
