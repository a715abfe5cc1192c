"""A gateway's port is shared only by the gateways of one mesh: a port another process serves (a
gRPC server, which sets SO_REUSEPORT and would let a second server in silently, or a stale gateway
of another mesh) fails the start, naming that process."""
from __future__ import annotations

import os
import subprocess
import sys

import grpc
import pytest

from batchline.ports import PortInUse, redacted
from gateway.app import GatewayApp
from gateway.settings import GatewaySettings


@pytest.fixture
def foreign_server(mesh):
    """An unrelated gRPC server (SO_REUSEPORT, as gRPC sets by default) on a free port of its own."""
    async def start():
        server = grpc.aio.server()
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = mesh.call(start())
    yield port
    mesh.call(server.stop(0))


def _gateway(redis_url: str, port: int, **overrides) -> GatewayApp:
    return GatewayApp(GatewaySettings(**{"redis_url": redis_url, "port": port, "metrics_port": -1, "http_port": -1,
                                         **overrides}))


@pytest.mark.parametrize("share_port", [False, True])
def test_a_gateway_on_a_port_another_process_serves_fails_to_start_naming_it(mesh, foreign_server, share_port):
    with pytest.raises(PortInUse) as info:
        mesh.call(_gateway(mesh.redis_url, foreign_server, share_port=share_port).start())
    assert str(info.value).startswith(f"port {foreign_server} is in use by pid {os.getpid()} ("), str(info.value)


def test_the_gateways_of_one_mesh_share_their_port_and_no_other_meshs_gateway_joins(mesh_factory, redis_server):
    m = mesh_factory(models=["mlp"], gateway_overrides={"share_port": True})
    port = m.gateway.port
    second = m.call(_gateway(m.redis_url, port, share_port=True).start())
    try:
        assert second.port == port
        # A gateway of another mesh (another Redis) may not, though it asks to share.
        with pytest.raises(PortInUse) as info:
            m.call(_gateway(redis_server.url, port, share_port=True).start())
        assert str(info.value).startswith(f"port {port} is in use by pid {os.getpid()} ("), str(info.value)
    finally:
        m.call(second.stop(0))


def test_a_gateway_process_and_batchline_up_on_a_served_port_exit_in_one_line(mesh, foreign_server, model_repository):
    runs = {
        "gateway": [sys.executable, "-m", "gateway", "--redis-url", mesh.redis_url, "--port", str(foreign_server),
                    "--metrics-port", "-1", "--http-port", "-1"],
        "up": [sys.executable, "-m", "batchline.cli", "up", "--redis-url", mesh.redis_url, "--model-repository",
               str(model_repository), "--gateway-port", str(foreign_server), "--metrics-port", "-1", "--http-port",
               "-1"],
    }
    for what, cmd in runs.items():
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert done.returncode != 0 and "Traceback" not in done.stderr, (what, done.stdout, done.stderr)
        # (the gateway's log lines go to stderr before it)
        last = done.stderr.strip().splitlines()[-1]
        assert f"port {foreign_server} is in use by pid {os.getpid()} (" in last, (what, done.stderr)


def test_the_command_line_a_refusal_names_keeps_no_credentials():
    argv = ["python", "-m", "gateway", "--redis-url", "unix://:s3cret@/tmp/redis.sock?db=0", "--redis-password",
            "hunter2", "--auth-file=/etc/auth.toml", "rediss://user:pw@host:6380/0", ""]
    shown = redacted(argv)
    assert "s3cret" not in shown and "hunter2" not in shown and "pw@" not in shown, shown
    assert shown == ("python -m gateway --redis-url unix://***@/tmp/redis.sock?db=0 --redis-password *** "
                     "--auth-file=/etc/auth.toml rediss://***@host:6380/0")


def test_the_rest_port_is_shared_and_refused_as_the_grpc_port_is(mesh_factory, foreign_server):
    m = mesh_factory(models=["mlp"], gateway_overrides={"share_port": True})
    with pytest.raises(PortInUse) as info:
        m.call(_gateway(m.redis_url, 0, http_port=foreign_server).start())
    assert str(info.value).startswith(f"port {foreign_server} is in use by pid {os.getpid()} (")
    assert str(info.value).endswith("(--http-port)"), str(info.value)
    # Another gateway of the mesh joins both of its ports.
    second = m.call(_gateway(m.redis_url, m.gateway.port, share_port=True, http_port=m.gateway.http_port).start())
    try:
        assert (second.port, second.http_port) == (m.gateway.port, m.gateway.http_port)
    finally:
        m.call(second.stop(0))
