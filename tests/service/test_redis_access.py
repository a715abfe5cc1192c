"""Redis with a password, ACL users and TLS: real redis-server processes, real certificates; a
service refused by Redis stops at once with one line, and no secret in it."""
from __future__ import annotations

import shutil
import subprocess
import sys

import numpy as np
import pytest
import redis
import tritonclient.grpc as tc

from batchline.embedded_redis import EmbeddedRedis, free_port, redis_server_binary
from batchline.redis_client import mask
from batchline.testing.certs import Authority
from batchline.testing.polling import poll

SECRET = "the-right-secret"


def _service_refused(url: str) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "scheduler", "--redis-url", url, "--port", "0", "--metrics-port", "-1"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("scheduler: "), out.stderr
    return out


def test_a_wrong_or_missing_password_stops_a_service_in_one_line_without_the_secret():
    with EmbeddedRedis(password=SECRET) as server:
        wrong = server.url.replace(SECRET, "a-wrong-secret")
        out = _service_refused(wrong)
        assert "refuses the credentials" in out.stderr and "a-wrong-secret" not in out.stderr + out.stdout
        assert ":***@" in out.stderr
        out = _service_refused(server.url.replace(f":{SECRET}@", ""))
        assert "refuses the credentials" in out.stderr
        assert redis.Redis.from_url(server.url).ping()  # the right one is let in


def test_urls_are_shown_without_their_password():
    assert mask("redis://:s3cret@127.0.0.1:6379/0") == "redis://:***@127.0.0.1:6379/0"
    assert mask("rediss://mesh:s3cret@redis.example:6380/0?ssl_ca_certs=/ca.pem") == \
        "rediss://mesh:***@redis.example:6380/0?ssl_ca_certs=/ca.pem"
    assert mask("unix://:s3cret@/tmp/x/redis.sock?db=0") == "unix://:***@/tmp/x/redis.sock?db=0"
    assert mask("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    # Passwords given as options, which redis-py takes too: the server's and a TLS key's passphrase.
    shown = mask("rediss://h:1/0?password=s3cret&ssl_password=k3y&ssl_ca_certs=/ca.pem")
    assert "s3cret" not in shown and "k3y" not in shown and "ssl_ca_certs=/ca.pem" in shown, shown


@pytest.fixture
def tls_redis(tmp_path):
    """A redis-server serving TLS only, with an ACL user `mesh`; yields (port, CA file)."""
    ca = Authority(tmp_path, "redis")
    cert, key = ca.issue("redis")
    port = free_port()
    proc = subprocess.Popen([redis_server_binary(), "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
                             "--tls-cert-file", cert, "--tls-key-file", key, "--tls-ca-cert-file", ca.file,
                             "--tls-auth-clients", "no", "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    admin = redis.Redis(host="localhost", port=port, ssl=True, ssl_ca_certs=ca.file)
    try:
        poll(lambda: _pong(admin), 15, "the TLS Redis to answer")
        admin.execute_command("ACL", "SETUSER", "mesh", "on", f">{SECRET}", "~*", "&*", "+@all")
        admin.execute_command("ACL", "SETUSER", "default", "off")  # only the user gets in
        yield port, ca.file
    finally:
        admin.close()
        proc.kill()
        proc.wait(10)
        proc.stderr.close()


def _pong(client: redis.Redis) -> bool:
    try:
        return client.ping()
    except redis.exceptions.ConnectionError:
        return False


def test_the_mesh_serves_through_a_tls_redis_as_an_acl_user(tls_redis, model_repository, tmp_path):
    from batchline.testing.in_process import InProcessMesh

    port, ca = tls_redis
    url = f"rediss://mesh:{SECRET}@localhost:{port}/0?ssl_ca_certs={ca}"
    repo = tmp_path / "repository"
    shutil.copytree(model_repository / "mlp", repo / "mlp")
    with InProcessMesh(url, str(repo), models=["mlp"]) as m, tc.InferenceServerClient(m.address) as client:
        inp = tc.InferInput("features", [1, 32], "FP32").set_data_from_numpy(np.ones((1, 32), np.float32))
        assert client.infer("mlp", [inp]).as_numpy("probability").shape == (1, 1)


def test_an_untrusted_redis_certificate_stops_a_service_in_one_line(tls_redis, tmp_path):
    port, _ = tls_redis
    stranger = Authority(tmp_path, "stranger")
    out = _service_refused(f"rediss://mesh:{SECRET}@localhost:{port}/0?ssl_ca_certs={stranger.file}")
    assert "cannot verify the TLS certificate" in out.stderr and SECRET not in out.stderr


def test_a_redis_cluster_node_named_as_one_redis_stops_a_service_in_one_line(tmp_path):
    """A plain redis:// URL naming a cluster node would be refused (MOVED) request by request:
    refused at start, in one line saying how to name a cluster."""
    # Its own bus port: port + 10000 may be taken or past 65535.
    with EmbeddedRedis(extra_args=("--cluster-enabled", "yes", "--cluster-config-file", str(tmp_path / "nodes.conf"),
                                   "--cluster-port", str(free_port()))) as node:
        out = _service_refused(node.url)
        assert "is a Redis Cluster node" in out.stderr and "redis+cluster://" in out.stderr
