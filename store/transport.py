"""Celery, the transport from the scheduler to a device's worker: the app, the queue of each
device, kombu's priority lists, and the task message the placement script pushes. The one
module that knows Celery's and kombu's wire format.

Celery is only the transport here: a message says "run job X under dispatch D" and the job's
state, progress and result live in the store's own keys. Hence no result backend, JSON only (a
pickle from the network would run code), and no redelivery by Celery when a worker dies: the
scheduler re-places lost jobs itself and counts the attempts, so a job that kills workers fails
as poison instead of looping (facts/celery.md).

kombu's Redis transport stores a message as one JSON document LPUSHed on a list named after
the queue (priority 0 is the plain name). Calling `send_task` per job cost the scheduler about
1.3 ms of Python on the path of every job, and it was a second write after the placement: a
scheduler that died between the two left a placed job without a message. Instead the outbox
captures, once, the exact document Celery itself publishes for TASK_NAME (sent to a private
probe queue and popped back at once) and fills in per job only what differs: the arguments in
the body, the task id, the delivery tag and the routing key. The placement script pushes it
in the same atomic step that records the placement, so a job is placed and sent, or neither.
The template is checked when captured: a Celery whose message layout differs from protocol 2
as read here makes the scheduler fail at start with a clear error, not misroute jobs.
"""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Callable
from typing import Any, NamedTuple

TASK_NAME = "sdfarm.generate"
PRIORITY_STEPS = (0, 3, 6, 9)
"""kombu's redis transport keeps one list per priority step: `queue` and `queue\\x06\\x16{n}`."""
VISIBILITY_TIMEOUT_S = 3600

JOB_MARK = "<job>"
DISPATCH_MARK = "<dispatch>"


class TemplateError(RuntimeError):
    """The captured Celery message is not laid out as this module expects."""


def queue_name(device_key: str) -> str:
    """The Celery queue of one device (`{host}/{device}`): `sdfarm.{host}.{device}`."""
    return "sdfarm." + device_key.replace("/", ".")


def queue_lists(device_key: str) -> list[str]:
    """The Redis lists that hold the device's waiting messages, one per priority step."""
    q = queue_name(device_key)
    return [q if step == 0 else f"{q}\x06\x16{step}" for step in PRIORITY_STEPS]


def make_app(redis_url: str, task: Callable[..., Any] | None = None, prefetch: int = 1) -> Any:
    """A Celery app on `redis_url`; with `task` (the worker's), registered as TASK_NAME.
    `prefetch` is the messages the worker's main process reserves per pool process
    (sdfarm.worker.app.prefetch)."""
    from celery import Celery

    from sdfarm.store.connect import celery_broker

    broker, sentinel_options = celery_broker(redis_url)
    app = Celery("sdfarm", broker=broker, set_as_current=False)
    app.conf.update(
        broker_connection_retry_on_startup=True,
        result_backend=None,
        task_ignore_result=True,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        event_serializer="json",
        # Long jobs: acknowledge a message when its job ends; reserve `prefetch` per process.
        task_acks_late=True,
        worker_prefetch_multiplier=prefetch,
        # A dead child's message is acknowledged, not redelivered: the scheduler re-places.
        task_reject_on_worker_lost=False,
        worker_hijack_root_logger=False,
        worker_send_task_events=False,
        task_send_sent_event=False,
        worker_enable_remote_control=True,
        broker_transport_options={"visibility_timeout": VISIBILITY_TIMEOUT_S, **sentinel_options},
    )
    if task is not None:
        app.task(name=TASK_NAME, ignore_result=True, acks_late=True)(task)
    return app


def on_pool_process(start: Callable[..., Any], stop: Callable[..., Any]) -> None:
    """Run `start` in each pool process Celery forks (worker_process_init; it must return
    within Celery's 4 s limit) and `stop` when that process shuts down."""
    from celery import signals

    signals.worker_process_init.connect(start, weak=False)
    signals.worker_process_shutdown.connect(stop, weak=False)


def on_worker_stopping(callback: Callable[[], Any]) -> None:
    """Run `callback` in the main process when the worker begins to shut down
    (worker_shutting_down: SIGTERM, SIGINT, a remote shutdown)."""
    from celery import signals

    signals.worker_shutting_down.connect(lambda **_: callback(), weak=False)


def run_worker(app: Any, hostname: str, queue: str, concurrency: int = 1) -> int:
    """A prefork pool of `concurrency` processes (one per engine slot) consuming `queue`
    only, until SIGTERM (running jobs finish first); its exit code. The main process
    reserves at most the app's prefetch of messages per pool process."""
    worker = app.Worker(
        hostname=hostname,
        pool_cls="prefork",
        concurrency=concurrency,
        queues=[queue],
        loglevel="WARNING",
        without_gossip=True,
        without_mingle=True,
        without_heartbeat=True,
        quiet=True,
        redirect_stdouts=False,
    )
    worker.start()
    return int(worker.exitcode or 0)


def send(app: Any, job_id: str, dispatch: str, device_key: str) -> None:
    """Send one task message the way Celery does (for tests that play the scheduler)."""
    app.send_task(TASK_NAME, args=[job_id, dispatch], queue=queue_name(device_key))


class CeleryOutbox:
    """Builds (list key, message) pairs for TASK_NAME messages on a device's queue."""

    def __init__(self, client: Any, app: Any) -> None:
        self.r = client
        self.app = app
        self._template: dict[str, Any] | None = None

    @classmethod
    def for_farm(cls, client: Any, redis_url: str) -> CeleryOutbox:
        """The outbox of the farm's Celery app, its template captured now, so a Celery it
        cannot read stops the scheduler when it takes the lead."""
        return cls(client, make_app(redis_url)).prepare()

    def capture(self) -> dict[str, Any]:
        """Send one real message to a probe queue, pop it back, remove the probe's traces."""
        probe = f"sdfarm.probe.{uuid.uuid4().hex}"
        self.app.send_task(TASK_NAME, args=[JOB_MARK, DISPATCH_MARK], queue=probe)
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

    def message(self, job_id: str, dispatch: str, device_key: str) -> tuple[str, str]:
        """The Redis list to LPUSH and the message that runs `job_id` under `dispatch`."""
        template = self.prepare()._template
        assert template is not None
        queue = queue_name(device_key)
        return queue, render(template, job_id, dispatch, queue)


def check_template(doc: dict[str, Any]) -> dict[str, Any]:
    """`doc` if it is a protocol-2 message of TASK_NAME with the marker arguments in a base64
    JSON body, sent without priority; TemplateError naming what differs otherwise."""
    try:
        headers, props = doc["headers"], doc["properties"]
        if headers["task"] != TASK_NAME or headers["id"] != props["correlation_id"]:
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
    as its routing key. Only the parts that change are copied (a deep copy of the whole
    template per job was most of the scheduler's cost of sending one); the template itself
    is never changed."""
    body = json.loads(base64.b64decode(template["body"]))
    body[0] = [job_id, dispatch]
    task_id = str(uuid.uuid4())
    headers = {**template["headers"], "id": task_id, "root_id": task_id,
               "argsrepr": repr([job_id, dispatch])}  # fmt: skip
    props = template["properties"]
    delivery = {**props["delivery_info"], "exchange": "", "routing_key": queue}
    props = {**props, "correlation_id": task_id, "delivery_tag": str(uuid.uuid4()),
             "delivery_info": delivery}  # fmt: skip
    doc = {**template, "headers": headers, "properties": props,
           "body": base64.b64encode(json.dumps(body).encode()).decode()}  # fmt: skip
    return json.dumps(doc)


# -- taking a device's next message directly (sdfarm.worker.chain) ---------------------------

_POP_FIRST = """
for i = 1, #KEYS - 1 do
    local raw = redis.call('RPOP', KEYS[i])
    if raw then
        redis.call('HSET', KEYS[#KEYS], ARGV[1], raw, ARGV[1] .. ':list', KEYS[i])
        redis.call('HDEL', KEYS[#KEYS], ARGV[1] .. ':job')
        return {KEYS[i], raw}
    end
end
return false
"""
"""RPOP from the first non-empty list, in the order given: what kombu's BRPOP over the same
lists does, without blocking (Redis 6.2 has no LMPOP). The message is kept, in the same step,
as the taker's held message (`held_key`), until it takes another; the job it claimed ahead
before (`:job`, store/lua/claim_ahead.lua) began by then and is held no more."""

_GIVE_BACK = """
redis.call('RPUSH', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[2], ARGV[2] .. ':list', ARGV[2] .. ':job')
return 1
"""


class Message(NamedTuple):
    """A task message taken from a device's lists: its job and dispatch, and where and how
    it was stored (to put it back untouched)."""

    job_id: str
    dispatch: str
    list_key: str
    raw: bytes


def held_key(device_key: str) -> str:
    """The hash of the messages a device's slots took from its lists, by taker (a slot's
    index): one each, its latest."""
    return f"{queue_name(device_key)}.held"


def parse(raw: str | bytes) -> tuple[str, str] | None:
    """(job id, dispatch) of a TASK_NAME message as this module renders it (protocol 2, a
    base64 JSON body whose first item is the two arguments); None for anything else."""
    try:
        doc = json.loads(raw)
        if doc["headers"]["task"] != TASK_NAME or doc.get("content-type") != "application/json":
            return None
        if doc["properties"].get("body_encoding") != "base64":
            return None
        args = json.loads(base64.b64decode(doc["body"]))[0]
        if len(args) == 2 and all(isinstance(a, str) and a for a in args):
            return str(args[0]), str(args[1])
    except (KeyError, IndexError, TypeError, ValueError):
        pass
    return None


def pop_next(client: Any, device_key: str, taker: str = "0") -> Message | None:
    """Take the device's next task message straight from its lists (highest priority list
    first, oldest message first, as Celery's consumer would); None when the lists are empty.
    The message stays recorded as `taker`'s held message until its next take, so a process
    that dies holding it is replaced by one that puts it back (`restore_held`). A message
    this module cannot read is put back where it was taken from, for Celery's own consumer,
    and None returned."""
    lists = queue_lists(device_key)
    got = client.eval(_POP_FIRST, len(lists) + 1, *lists, held_key(device_key), taker)
    if not got:
        return None
    key, raw = got
    found = parse(raw) or ("", "")
    message = Message(*found, key.decode() if isinstance(key, bytes) else key, raw)
    if not message.job_id:
        push_back(client, device_key, message, taker)
        return None
    return message


def push_back(client: Any, device_key: str, message: Message, taker: str = "0") -> None:
    """Put a message `taker` took back at the head of the list it came from, and hold it no
    more (a stopping worker returns the message it took ahead)."""
    client.eval(_GIVE_BACK, 2, message.list_key, held_key(device_key), message.raw, taker)


def forget_held(client: Any, device_key: str, taker: str = "0") -> None:
    """`taker` holds no message any more (its chain ended: every message it took ran)."""
    client.hdel(held_key(device_key), taker, f"{taker}:list", f"{taker}:job")
