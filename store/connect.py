"""The one place a farm's Redis URL becomes a connection: a plain `redis://` (`rediss://`,
`unix://`) URL, or `redis+sentinel://` for a farm whose Redis fails over.

    redis+sentinel://[:password@]host:port[,host:port...]/service_name[/db][?sentinel_password=P]

names the sentinels (not the master) and the service they monitor. Every client of the farm
(Store, AsyncStore and its pub/sub, the gateway's rate limits, Celery's broker) asks the
sentinels for the current master here, so a failover moves all of them to the promoted replica
on their next reconnect. The password is the master's (and its replicas'); sentinels that have
their own `requirepass` take `sentinel_password`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

SENTINEL_SCHEME = "redis+sentinel"
DEFAULT_SENTINEL_PORT = 26379


class RedisURLError(ValueError):
    """A `redis+sentinel://` URL that cannot name a service (the message says what is wrong)."""


@dataclass(frozen=True)
class SentinelURL:
    """A parsed `redis+sentinel://` URL."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    password: str | None = None
    sentinel_password: str | None = None

    def connection_kwargs(self) -> dict[str, Any]:
        """The master connections' settings (its db and password)."""
        return {"db": self.db, **({"password": self.password} if self.password else {})}

    def sentinel_kwargs(self) -> dict[str, Any]:
        """The sentinel connections' settings (a short timeout: a dead sentinel is skipped)."""
        kwargs: dict[str, Any] = {"socket_timeout": 2.0, "socket_connect_timeout": 2.0}
        if self.sentinel_password:
            kwargs["password"] = self.sentinel_password
        return kwargs


def is_sentinel(url: str) -> bool:
    return url.startswith(SENTINEL_SCHEME + "://")


def parse_sentinel(url: str) -> SentinelURL:
    """The sentinels, service, db and passwords of a `redis+sentinel://` URL."""
    if not is_sentinel(url):
        raise RedisURLError(f"not a {SENTINEL_SCHEME}:// URL: {url!r}")
    parts = urlsplit(url)
    auth, _, hosts = parts.netloc.rpartition("@")
    password = unquote(auth.partition(":")[2]) if auth else None
    sentinels = tuple(_host_port(item, url) for item in hosts.split(",") if item)
    if not sentinels:
        raise RedisURLError(f"{url!r} names no sentinel host")
    path = [p for p in parts.path.split("/") if p]
    if not path or len(path) > 2:
        raise RedisURLError(f"{url!r}: the path must be /service_name[/db]")
    db = 0
    if len(path) == 2:
        if not path[1].isdigit():
            raise RedisURLError(f"{url!r}: db {path[1]!r} is not a number")
        db = int(path[1])
    query = parse_qs(parts.query)
    unknown = set(query) - {"sentinel_password"}
    if unknown:
        raise RedisURLError(f"{url!r}: unknown option(s) {sorted(unknown)}")
    sentinel_password = query.get("sentinel_password", [None])[0]
    return SentinelURL(sentinels, unquote(path[0]), db, password or None, sentinel_password)


def _host_port(item: str, url: str) -> tuple[str, int]:
    if item.startswith("["):  # [ipv6]:port
        host, _, rest = item[1:].partition("]")
        port = rest.removeprefix(":")
    else:
        host, _, port = item.rpartition(":") if ":" in item else (item, "", "")
    if not host:
        raise RedisURLError(f"{url!r}: empty sentinel host in {item!r}")
    if port and not port.isdigit():
        raise RedisURLError(f"{url!r}: sentinel port {port!r} is not a number")
    return host, int(port) if port else DEFAULT_SENTINEL_PORT


def sync_client(url: str, **options: Any) -> Any:
    """A redis-py client of the farm's Redis: for a sentinel URL, a client of the service's
    current master (its pool asks the sentinels again after a connection error)."""
    import redis

    if not is_sentinel(url):
        return redis.Redis.from_url(url, **options)
    from redis.sentinel import Sentinel

    s = parse_sentinel(url)
    sentinel = Sentinel(list(s.sentinels), sentinel_kwargs=s.sentinel_kwargs())
    return sentinel.master_for(s.service, **{**s.connection_kwargs(), **options})


def async_pool(url: str, max_connections: int, pool_wait_s: float, **options: Any) -> Any:
    """A redis.asyncio connection pool of the farm's Redis: a blocking pool of `url`, or for a
    sentinel URL a pool of the service's current master (redis-py has no blocking sentinel
    pool: past `max_connections` a request fails instead of waiting `pool_wait_s`)."""
    import redis.asyncio as aioredis

    if not is_sentinel(url):
        return aioredis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=pool_wait_s, **options
        )
    from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool

    s = parse_sentinel(url)
    sentinel = Sentinel(list(s.sentinels), sentinel_kwargs=s.sentinel_kwargs())
    kwargs = {**s.connection_kwargs(), **options, "max_connections": max_connections}
    return SentinelConnectionPool(s.service, sentinel, **kwargs)


def celery_broker(url: str) -> tuple[str, dict[str, Any]]:
    """Celery's broker URL and the transport options it adds for `url`: kombu's `sentinel://`
    transport takes one `sentinel://` URL per sentinel joined by `;` and the service as
    `master_name`; a plain URL is passed as is."""
    if not is_sentinel(url):
        return url, {}
    s = parse_sentinel(url)
    auth = f":{quote(s.password, safe='')}@" if s.password else ""
    hosts = [f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in s.sentinels]
    broker = ";".join(f"sentinel://{auth}{hp}/{s.db}" for hp in hosts)
    options: dict[str, Any] = {"master_name": s.service}
    if s.sentinel_password:
        options["sentinel_kwargs"] = {"password": s.sentinel_password}
    return broker, options
