"""The farm's Redis URL parser (store/connect.py): `redis+sentinel://` names sentinels, a
service and a db; Celery gets kombu's `sentinel://` form of the same; bad URLs are refused
naming what is wrong."""

from __future__ import annotations

import pytest

from sdfarm.store.connect import RedisURLError, celery_broker, is_sentinel, parse_sentinel


def test_full_url_parses() -> None:
    s = parse_sentinel("redis+sentinel://:p%40ss@h1:26380,h2,[::1]:26390/sdfarm/3")
    assert s.sentinels == (("h1", 26380), ("h2", 26379), ("::1", 26390))
    assert (s.service, s.db, s.password, s.sentinel_password) == ("sdfarm", 3, "p@ss", None)
    assert s.connection_kwargs() == {"db": 3, "password": "p@ss"}
    assert "password" not in s.sentinel_kwargs()


def test_defaults_and_sentinel_password() -> None:
    s = parse_sentinel("redis+sentinel://127.0.0.1:5000/main?sentinel_password=sp")
    assert (s.db, s.password, s.sentinel_password) == (0, None, "sp")
    assert s.connection_kwargs() == {"db": 0}
    assert s.sentinel_kwargs()["password"] == "sp"


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis+sentinel://h1:1/", "service_name"),
        ("redis+sentinel://h1:1/a/b/c", "service_name"),
        ("redis+sentinel://h1:1/a/x", "not a number"),
        ("redis+sentinel://h1:port/a", "not a number"),
        ("redis+sentinel:///a", "no sentinel"),
        ("redis+sentinel://h1/a?master=x", "unknown option"),
        ("redis://h1/0", r"not a redis\+sentinel"),
    ],
)
def test_bad_urls_are_refused(url: str, says: str) -> None:
    with pytest.raises(RedisURLError, match=says):
        parse_sentinel(url)


def test_celery_broker_of_a_sentinel_url() -> None:
    broker, options = celery_broker("redis+sentinel://:pw@h1:1,h2:2/svc/2?sentinel_password=s")
    assert broker == "sentinel://:pw@h1:1/2;sentinel://:pw@h2:2/2"
    assert options == {"master_name": "svc", "sentinel_kwargs": {"password": "s"}}


def test_plain_urls_pass_through() -> None:
    assert not is_sentinel("redis://h:1/0")
    assert celery_broker("redis://:pw@h:1/0") == ("redis://:pw@h:1/0", {})


def test_celery_app_carries_the_master_name() -> None:
    from sdfarm.store.transport import make_app

    app = make_app("redis+sentinel://h1:1,h2:2/svc")
    options = app.conf.broker_transport_options
    assert options["master_name"] == "svc" and options["visibility_timeout"] > 0
    assert app.conf.broker_url.startswith("sentinel://h1:1/0;")
