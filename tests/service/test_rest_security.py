"""The REST port secured as the gRPC port is: the same auth file's tokens and scopes, the same
tenant rate caps (429 with Retry-After), and TLS / mutual TLS from the same files, rotated without
a restart. Real gateways, real certificates, stock tritonclient.http and the standard library."""
from __future__ import annotations

import contextlib
import gc
import http.client
import json
import shutil
import ssl

import numpy as np
import pytest
import tritonclient.http as th
from prometheus_client import REGISTRY
from tritonclient.utils import InferenceServerException

from batchline.testing.auth_files import ADMIN, OTHER, SEARCH, token_entry, write_auth_file
from batchline.testing.certs import Authority

BODY = json.dumps({"inputs": [{"name": "features", "shape": [1, 32], "datatype": "FP32", "data": [1.0] * 32}]}).encode()


@contextlib.contextmanager
def http_client(url: str, **kwargs):
    client = th.InferenceServerClient(url, **kwargs)
    try:
        yield client
    finally:
        client.close()
        del client
        gc.collect()


def _request(port: int, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
             context: ssl.SSLContext | None = None) -> tuple[int, dict, bytes]:
    connection = (http.client.HTTPSConnection("localhost", port, timeout=30, context=context) if context
                  else http.client.HTTPConnection("127.0.0.1", port, timeout=30))
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        connection.close()


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def guarded(mesh_factory, tmp_path):
    path = tmp_path / "auth.toml"
    capped = token_entry("capped-secret-4", "capped", ["mlp"]).replace("max_rate = 0", "max_rate = 1")
    write_auth_file(path, token_entry(SEARCH, "search", ["ml*"]), token_entry(OTHER, "other", ["minilm"]),
           token_entry(ADMIN, "ops", ["*"], admin=True), capped)
    return mesh_factory(models=["mlp"], gateway_overrides={"auth_file": str(path)})


def test_tokens_and_scopes_are_the_grpc_ports(guarded):
    port = guarded.gateway.http_port
    # Probes are open.
    assert _request(port, "GET", "/v2/health/live")[0] == 200
    assert _request(port, "GET", "/v2/health/ready")[0] == 200
    status, headers, body = _request(port, "POST", "/v2/models/mlp/infer", BODY)
    assert status == 401 and "this gateway needs a token" in json.loads(body)["error"]
    assert headers["www-authenticate"] == "Bearer"
    status, _, body = _request(port, "POST", "/v2/models/mlp/infer", BODY, {"Authorization": "Basic abc"})
    assert status == 401 and "must read `Bearer <token>`" in json.loads(body)["error"]
    status, _, body = _request(port, "POST", "/v2/models/mlp/infer", BODY, _bearer("not-a-token"))
    assert status == 401 and "not known to this gateway" in json.loads(body)["error"]
    status, _, body = _request(port, "POST", "/v2/models/mlp/infer", BODY, _bearer(OTHER))
    assert status == 403 and json.loads(body)["error"] == "tenant 'other' may not call model 'mlp'"
    assert _request(port, "POST", "/v2/models/mlp/infer", BODY, _bearer(SEARCH))[0] == 200
    # A model in the scope that nobody serves is 404 naming no served model outside the scope; an
    # empty name is judged by the scope, which holds none.
    for path in ("/v2/models/minilm/infer", "/v2/models/minilm", "/v2/models/minilm/config"):
        method, body = ("POST", BODY) if path.endswith("infer") else ("GET", None)
        status, _, answer = _request(port, method, path, body, _bearer(OTHER))
        assert status == 404 and "(served models: none)" in json.loads(answer)["error"], (path, answer)
        assert "(served models: mlp)" in json.loads(_request(port, method, path, body, _bearer(ADMIN))[2])["error"]
    status, _, answer = _request(port, "POST", "/v2/models//infer", BODY, _bearer(OTHER))
    assert status == 403 and json.loads(answer)["error"] == "tenant 'other' may not call model ''"
    # Two tokens (a proxy's added to the caller's): refused, not the first or the last taken.
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.putrequest("GET", "/v2/models/mlp")
        for token in (OTHER, SEARCH):
            connection.putheader("Authorization", f"Bearer {token}")
        connection.endheaders()
        response = connection.getresponse()
        assert response.status == 401 and "send one" in json.loads(response.read())["error"]
    finally:
        connection.close()

    with http_client(guarded.http_address) as client:
        inp = th.InferInput("features", [1, 32], "FP32")
        inp.set_data_from_numpy(np.ones((1, 32), np.float32))
        assert client.infer("mlp", [inp], headers=_bearer(SEARCH)).as_numpy("probability").shape == (1, 1)
        assert client.get_model_metadata("mlp", headers=_bearer(SEARCH))["name"] == "mlp"
        with pytest.raises(InferenceServerException) as info:
            client.get_inference_statistics("mlp", headers=_bearer(SEARCH))
        assert info.value.status() == "403" and "needs an admin token" in info.value.message()
        assert client.get_inference_statistics("mlp", headers=_bearer(ADMIN))["model_stats"][0]["name"] == "mlp"
        # A token sees only the models it may call.
        assert [e["name"] for e in client.get_model_repository_index(headers=_bearer(OTHER))] == []
        assert [e["name"] for e in client.get_model_repository_index(headers=_bearer(SEARCH))] == ["mlp"]


def test_a_tenant_over_its_rate_is_429_with_retry_after(guarded):
    port = guarded.gateway.http_port
    answers = [_request(port, "POST", "/v2/models/mlp/infer", BODY, _bearer("capped-secret-4")) for _ in range(4)]
    refused = [(headers, body) for status, headers, body in answers if status == 429]
    assert refused and all(status in (200, 429) for status, _, _ in answers)
    headers, body = refused[0]
    assert "tenant 'capped' is over its rate of 1 requests/s" in json.loads(body)["error"]
    assert int(headers["retry-after"]) >= 1 and 0 < int(headers["retry-after-ms"]) <= 1000
    # The rate is charged before the body is read, as gRPC charges it before the model is looked up.
    status, _, body = _request(port, "POST", "/v2/models/mlp/infer", b"{not json", _bearer("capped-secret-4"))
    assert status == 429, body


def test_a_body_refused_before_it_is_queued_is_counted_as_a_failure(guarded):
    def failures() -> float:
        return REGISTRY.get_sample_value("batchline_request_failure_total",
                                         {"model": "mlp", "version": "1", "reason": "invalid_argument"}) or 0.0

    port = guarded.gateway.http_port
    before = failures()
    status, _, _ = _request(port, "POST", "/v2/models/mlp/infer", b"{not json", _bearer(SEARCH))
    assert status == 400 and failures() == before + 1


def _context(ca: str, cert: tuple[str, str] | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=ca)
    if cert:
        context.load_cert_chain(*cert)
    return context


def test_tls_mutual_tls_and_rotation_from_the_grpc_ports_files(mesh_factory, tmp_path):
    old, new, clients = Authority(tmp_path, "old"), Authority(tmp_path, "new"), Authority(tmp_path, "clients")
    cert, key = tmp_path / "gateway.pem", tmp_path / "gateway.key"
    for src, dst in zip(old.issue("gateway"), (cert, key)):
        shutil.copy(src, dst)
    m = mesh_factory(models=["mlp"], gateway_overrides={
        "tls_cert_file": str(cert), "tls_key_file": str(key), "tls_client_ca_file": clients.file})
    port = m.gateway.http_port
    mine = clients.issue("search", server=False)
    assert _request(port, "POST", "/v2/models/mlp/infer", BODY, context=_context(old.file, mine))[0] == 200
    with pytest.raises((ssl.SSLError, ConnectionError)):  # no client certificate
        _request(port, "GET", "/v2/health/ready", context=_context(old.file))
    with pytest.raises((ssl.SSLError, ConnectionError, http.client.HTTPException)):  # plaintext
        _request(port, "GET", "/v2/health/ready")
    # tritonclient.http over TLS, unmodified.
    with http_client(f"localhost:{port}", ssl=True, ssl_context_factory=lambda: _context(old.file, mine)) as client:
        assert client.is_server_ready()
    # Rotation: new connections get the new certificate, no restart.
    new_cert, new_key = new.issue("gateway")
    shutil.copy(new_key, key)
    shutil.copy(new_cert, cert)
    assert _request(port, "POST", "/v2/models/mlp/infer", BODY, context=_context(new.file, mine))[0] == 200
    with pytest.raises(ssl.SSLCertVerificationError):
        _request(port, "GET", "/v2/health/ready", context=_context(old.file, mine))
