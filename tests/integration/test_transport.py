"""The transport's outbox against a real Redis and Celery's own messages.

That a rendered message really runs on a worker is shown by every farm test (each job
travels this way); here: the template is what Celery sent, nothing of the probe is left
behind, each message differs only where it must, and a layout we do not know is refused.
"""

from __future__ import annotations

import base64
import copy
import json

import pytest
import redis

from sdfarm.store.transport import (
    TASK_NAME,
    CeleryOutbox,
    TemplateError,
    check_template,
    held_key,
    make_app,
    queue_name,
    render,
)


@pytest.fixture
def outbox(redis_url: str) -> CeleryOutbox:
    return CeleryOutbox(redis.Redis.from_url(redis_url), make_app(redis_url))


def _body(doc: dict) -> list:
    return json.loads(base64.b64decode(doc["body"]))


def test_capture_leaves_nothing_behind_and_keeps_celerys_layout(outbox: CeleryOutbox) -> None:
    template = outbox.capture()
    assert outbox.r.keys("*") == []  # probe queue and kombu's bindings removed
    assert template["headers"]["task"] == TASK_NAME
    assert _body(template)[0] == ["<job>", "<dispatch>"]


def test_messages_carry_their_job_and_fresh_ids(outbox: CeleryOutbox) -> None:
    queue, raw = outbox.message("job1", "disp1", "hostA/CUDA0")
    _, raw2 = outbox.message("job2", "disp2", "hostA/CUDA0")
    assert queue == queue_name("hostA/CUDA0") == "sdfarm.hostA.CUDA0"
    a, b = json.loads(raw), json.loads(raw2)
    assert _body(a)[0] == ["job1", "disp1"] and _body(b)[0] == ["job2", "disp2"]
    assert a["headers"]["id"] == a["properties"]["correlation_id"] == a["headers"]["root_id"]
    assert a["headers"]["id"] != b["headers"]["id"]
    assert a["properties"]["delivery_tag"] != b["properties"]["delivery_tag"]
    assert a["properties"]["delivery_info"] == {"exchange": "", "routing_key": queue}
    assert a["headers"]["argsrepr"] == "['job1', 'disp1']"
    # Everything else is Celery's own, untouched.
    for doc in (a, b):
        for k in ("id", "root_id", "argsrepr"):
            doc["headers"].pop(k)
        for k in ("correlation_id", "delivery_tag"):
            doc["properties"].pop(k)
        doc.pop("body")
    assert a == b


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda d: d["properties"].update(body_encoding="gzip"), "body encoding"),
        (lambda d: d["properties"].update(priority=6), "priority"),
        (lambda d: d.update({"content-type": "application/x-python-serialize"}), "content type"),
        (lambda d: d["headers"].update(task="other.task"), "task name"),
        (lambda d: d.update(body=base64.b64encode(b'[["x"], {}, {}]').decode()), "arguments"),
        (lambda d: d.pop("headers"), "layout"),
    ],
)
def test_an_unknown_layout_is_refused_naming_what_differs(
    outbox: CeleryOutbox, change, named: str
) -> None:
    template = outbox.capture()
    check_template(copy.deepcopy(template))  # the real one passes
    bad = copy.deepcopy(template)
    change(bad)
    with pytest.raises(TemplateError, match=named):
        check_template(bad)


def test_render_does_not_touch_the_template(outbox: CeleryOutbox) -> None:
    template = outbox.capture()
    before = copy.deepcopy(template)
    render(template, "j", "d", "q")
    assert template == before


# -- a worker taking its device's next message itself (sdfarm.worker.chain) -------------------


def test_pop_next_takes_celerys_order_and_leaves_what_it_cannot_read(
    outbox: CeleryOutbox,
) -> None:
    from sdfarm.store.transport import pop_next, queue_lists

    r, device = outbox.r, "hostA/CPU"
    lists = queue_lists(device)
    assert pop_next(r, device) is None  # nothing waiting
    for job, key in (("old", lists[0]), ("new", lists[0]), ("low", lists[2])):
        r.lpush(key, outbox.message(job, f"d-{job}", device)[1])
    # The first list first, and in it the oldest message (LPUSHed first), as BRPOP reads.
    got = [pop_next(r, device) for _ in range(4)]
    assert [m and (m.job_id, m.dispatch) for m in got] == [
        ("old", "d-old"),
        ("new", "d-new"),
        ("low", "d-low"),
        None,
    ]
    assert [m.list_key for m in got[:3]] == [lists[0], lists[0], lists[2]]
    r.lpush(lists[1], "not a celery message")
    assert pop_next(r, device) is None
    assert r.lrange(lists[1], 0, -1) == [b"not a celery message"]  # put back for Celery
    assert r.hgetall(held_key(device)) == {}  # and not held by the taker


def test_a_message_given_back_is_at_the_head_and_no_longer_held(outbox: CeleryOutbox) -> None:
    from sdfarm.store.transport import forget_held, pop_next, push_back, queue_lists

    r, device = outbox.r, "hostG/CPU"
    first = queue_lists(device)[0]
    for job in ("a", "b"):
        r.lpush(first, outbox.message(job, f"d-{job}", device)[1])
    a = pop_next(r, device)
    push_back(r, device, a)
    assert r.hgetall(held_key(device)) == {}
    assert [pop_next(r, device).job_id for _ in range(2)] == ["a", "b"]
    assert r.hgetall(held_key(device)) != {}
    forget_held(r, device)  # the chain ended: the last message taken ran
    assert r.hgetall(held_key(device)) == {}


def test_celerys_own_send_task_message_parses(outbox: CeleryOutbox) -> None:
    from sdfarm.store.transport import pop_next, send

    send(outbox.app, "job9", "disp9", "hostB/CPU")
    got = pop_next(outbox.r, "hostB/CPU")
    assert (got.job_id, got.dispatch) == ("job9", "disp9")
