"""TLS and mutual TLS on the gateway's port: real certificates, made here, served by a real
gateway, presented by the stock tritonclient; a certificate rotated on disk is served without a
restart."""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.utils import InferenceServerException

from batchline.testing.certs import Authority
from batchline.testing.polling import poll


def _infer(address: str, **ssl) -> np.ndarray:
    with tc.InferenceServerClient(address, ssl=bool(ssl), **ssl) as client:
        inp = tc.InferInput("features", [1, 32], "FP32").set_data_from_numpy(np.ones((1, 32), np.float32))
        return client.infer("mlp", [inp], client_timeout=10).as_numpy("probability")


def _refused(address: str, **ssl) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as info:
        _infer(address, **ssl)
    assert info.value.status() == "StatusCode.UNAVAILABLE", info.value
    return info.value


def test_tls_serves_inference_and_health_and_refuses_plaintext(mesh_factory, tmp_path):
    ca = Authority(tmp_path, "server")
    cert, key = ca.issue("gateway")
    m = mesh_factory(models=["mlp"], gateway_overrides={"tls_cert_file": cert, "tls_key_file": key})
    address = f"localhost:{m.gateway.port}"
    assert _infer(address, root_certificates=ca.file).shape == (1, 1)
    # Health and reflection live on the same port: over TLS too.
    with open(ca.file, "rb") as f:
        channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(f.read()))
    with channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    _refused(address)  # plaintext
    _refused(address, root_certificates=Authority(tmp_path, "stranger").file)  # a CA that did not sign it


def test_mutual_tls_wants_a_client_certificate_signed_by_the_clients_ca(mesh_factory, tmp_path):
    servers, clients = Authority(tmp_path, "servers"), Authority(tmp_path, "clients")
    cert, key = servers.issue("gateway")
    m = mesh_factory(models=["mlp"], gateway_overrides={
        "tls_cert_file": cert, "tls_key_file": key, "tls_client_ca_file": clients.file})
    address = f"localhost:{m.gateway.port}"
    client_cert, client_key = clients.issue("search", server=False)
    assert _infer(address, root_certificates=servers.file, certificate_chain=client_cert,
                  private_key=client_key).shape == (1, 1)
    _refused(address, root_certificates=servers.file)  # no client certificate
    other_cert, other_key = Authority(tmp_path, "others").issue("intruder", server=False)
    _refused(address, root_certificates=servers.file, certificate_chain=other_cert, private_key=other_key)


def test_a_rotated_certificate_is_served_to_new_connections_without_a_restart(mesh_factory, tmp_path):
    old, new = Authority(tmp_path, "old"), Authority(tmp_path, "new")
    cert, key = tmp_path / "gateway.pem", tmp_path / "gateway.key"
    for src, dst in zip(old.issue("gateway"), (cert, key)):
        shutil.copy(src, dst)
    m = mesh_factory(models=["mlp"], gateway_overrides={"tls_cert_file": str(cert), "tls_key_file": str(key)})
    address = f"localhost:{m.gateway.port}"
    assert _infer(address, root_certificates=old.file).shape == (1, 1)
    _refused(address, root_certificates=new.file)
    new_cert, new_key = new.issue("gateway")
    shutil.copy(new_key, key)
    shutil.copy(new_cert, cert)
    assert _infer(address, root_certificates=new.file).shape == (1, 1)
    _refused(address, root_certificates=old.file)


@pytest.mark.parametrize("flags, named", [
    (["--tls-cert-file", "/etc/hostname"], "tls_key_file is not set"),
    (["--tls-client-ca-file", "/etc/hostname"], "tls_client_ca_file needs tls_cert_file"),
    (["--tls-cert-file", "/no/such.pem", "--tls-key-file", "/no/such.key"],
     "tls_cert_file '/no/such.pem' is not a readable file"),
])
def test_tls_settings_that_cannot_work_are_one_line_errors(flags, named):
    out = subprocess.run([sys.executable, "-m", "gateway", *flags], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and named in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_up_passes_tls_and_mutual_tls_to_its_gateways(model_repository, tmp_path):
    servers, clients = Authority(tmp_path, "servers"), Authority(tmp_path, "clients")
    cert, key = servers.issue("gateway")
    repo = tmp_path / "repository"
    shutil.copytree(model_repository / "mlp", repo / "mlp")
    proc = subprocess.Popen(
        [sys.executable, "-m", "batchline.cli", "up", "--model-repository", str(repo), "--gateway-port", "0",
         "--metrics-port", "-1", "--http-port", "-1", "--log-level", "WARNING", "--tls-cert", cert, "--tls-key", key,
         "--tls-client-ca", clients.file],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    try:
        up = poll(lambda: re.search(r"listening on \S+:(\d+);", "".join(lines)), 120, "batchline up to be up")
        address = f"localhost:{up.group(1)}"
        client_cert, client_key = clients.issue("search", server=False)
        assert _infer(address, root_certificates=servers.file, certificate_chain=client_cert,
                      private_key=client_key).shape == (1, 1)
        _refused(address, root_certificates=servers.file)
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(60) == 0, "".join(lines)
