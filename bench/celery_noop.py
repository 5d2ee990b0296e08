"""A no-op Celery task on $SDFARM_REDIS_URL with our worker's settings (JSON, acks late,
prefetch 1, prefork, one process) and a Redis result backend: the floor a farm job's added
latency is measured against (bench/farm_overhead.py starts its worker)."""

from __future__ import annotations

import os

from celery import Celery

app = Celery("noop", broker=os.environ["SDFARM_REDIS_URL"], backend=os.environ["SDFARM_REDIS_URL"])
app.conf.update(
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    task_acks_late=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
)


@app.task(name="noop")
def noop(x: int) -> int:
    return x
