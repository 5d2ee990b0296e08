"""The Celery app that carries jobs from the scheduler to a device's worker.

Celery is only the transport here: a message says "run job X under dispatch D" and the job's
state, progress and result live in our own Redis keys (worker/protocol.py). Hence no result
backend, JSON only (a pickle from the network would run code), and no redelivery by Celery
when a worker dies: the scheduler re-places lost jobs itself and counts the attempts, so a
job that kills workers fails as poison instead of looping (facts/celery.md).
"""

from __future__ import annotations

from celery import Celery

from sdfarm.worker.protocol import TASK_NAME


def make_app(redis_url: str) -> Celery:
    """A Celery app on `redis_url` with the generate task registered as TASK_NAME. The
    scheduler captures this app's message once (sdfarm.scheduler.outbox) and pushes a copy
    per job to queue_name(device_key) from its placement script."""
    app = Celery("sdfarm", broker=redis_url, set_as_current=False)
    app.conf.update(
        broker_connection_retry_on_startup=True,
        result_backend=None,
        task_ignore_result=True,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        event_serializer="json",
        # Long jobs: hold exactly the message being run, acknowledge it when it ends.
        task_acks_late=True,
        worker_prefetch_multiplier=1,
        # A dead child's message is acknowledged, not redelivered: the scheduler re-places.
        task_reject_on_worker_lost=False,
        worker_hijack_root_logger=False,
        worker_send_task_events=False,
        task_send_sent_event=False,
        worker_enable_remote_control=True,
        broker_transport_options={"visibility_timeout": 3600},
    )
    from sdfarm.worker.tasks import run_job

    app.task(name=TASK_NAME, ignore_result=True, acks_late=True)(run_job)
    return app
