"""Celery task messages written by the scheduler's placement script itself.

kombu's Redis transport stores a message as one JSON document LPUSHed on a list named after
the queue (priority 0 is the plain name). Calling `send_task` per job cost the scheduler about
1.3 ms of Python on the path of every job, and it was a second write after the placement: a
scheduler that died between the two left a placed job without a message, which the next
leader had to find and re-queue. Instead the outbox captures, once, the exact document Celery itself
publishes for TASK_NAME (sent to a private probe queue and popped back at once) and fills in
per job only what differs: the arguments in the body, the task id and the delivery tag and
routing key. The placement script LPUSHes the result in the same atomic step that records the
placement, so a job is placed and sent, or neither.

The template is checked when captured: a Celery whose message layout differs from protocol 2
as read here makes the scheduler fail at start with a clear error, not misroute jobs.
"""

from __future__ import annotations

import base64
import copy
import json
import uuid
from typing import Any

from sdfarm.worker import protocol

JOB_MARK = "<job>"
DISPATCH_MARK = "<dispatch>"


class TemplateError(RuntimeError):
    """The captured Celery message is not laid out as this module expects."""


class CeleryOutbox:
    """Builds (list key, message) pairs for TASK_NAME messages on a device's queue."""

    def __init__(self, client: Any, app: Any) -> None:
        self.r = client
        self.app = app
        self._template: dict[str, Any] | None = None

    def capture(self) -> dict[str, Any]:
        """Send one real message to a probe queue, pop it back, remove the probe's traces."""
        probe = f"sdfarm.probe.{uuid.uuid4().hex}"
        self.app.send_task(protocol.TASK_NAME, args=[JOB_MARK, DISPATCH_MARK], queue=probe)
        raw = self.r.rpop(probe)
        self.r.delete(probe, f"_kombu.binding.{probe}", f"_kombu.binding_permanent.{probe}")
        if raw is None:
            raise TemplateError(f"the probe message on {probe} did not arrive")
        return check_template(json.loads(raw))

    def prepare(self) -> CeleryOutbox:
        """Capture the template now (once): a Celery it cannot read fails here, not at the
        first job."""
        if self._template is None:
            self._template = self.capture()
        return self

    def message(self, job_id: str, dispatch: str, device: str) -> tuple[str, str]:
        """The Redis list to LPUSH and the message that runs `job_id` under `dispatch`."""
        template = self.prepare()._template
        assert template is not None
        queue = protocol.queue_name(device)
        return queue, render(template, job_id, dispatch, queue)


def check_template(doc: dict[str, Any]) -> dict[str, Any]:
    """`doc` if it is a protocol-2 message of TASK_NAME with the marker arguments in a base64
    JSON body, sent without priority; TemplateError naming what differs otherwise."""
    try:
        headers, props = doc["headers"], doc["properties"]
        if headers["task"] != protocol.TASK_NAME or headers["id"] != props["correlation_id"]:
            raise TemplateError("task name or id not where protocol 2 puts them")
        if props.get("body_encoding") != "base64" or props.get("priority", 0) not in (0, None):
            raise TemplateError(f"unexpected body encoding or priority in {props}")
        if doc.get("content-type") != "application/json":
            raise TemplateError(f"content type {doc.get('content-type')!r}, not JSON")
        body = json.loads(base64.b64decode(doc["body"]))
        if body[0] != [JOB_MARK, DISPATCH_MARK] or body[1] != {}:
            raise TemplateError(f"the arguments are not the body's first item: {body!r}")
        props["delivery_info"]["routing_key"]  # noqa: B018 - must exist
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise TemplateError(f"unexpected Celery message layout: {exc!r}") from exc
    return doc


def render(template: dict[str, Any], job_id: str, dispatch: str, queue: str) -> str:
    """The template with this job's arguments, a fresh task id and delivery tag, and `queue`
    as its routing key."""
    doc = copy.deepcopy(template)
    body = json.loads(base64.b64decode(doc["body"]))
    body[0] = [job_id, dispatch]
    doc["body"] = base64.b64encode(json.dumps(body).encode()).decode()
    task_id = str(uuid.uuid4())
    headers, props = doc["headers"], doc["properties"]
    headers.update(id=task_id, root_id=task_id, argsrepr=repr([job_id, dispatch]))
    props.update(correlation_id=task_id, delivery_tag=str(uuid.uuid4()))
    props["delivery_info"].update(exchange="", routing_key=queue)
    return json.dumps(doc)
