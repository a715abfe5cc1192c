"""Token auth with per-model scopes: a real gateway with a real auth file, the stock tritonclient
(sync, aio, streaming), and Redis checked for what a refused request leaves (nothing)."""
from __future__ import annotations

import asyncio
import hashlib
import queue
import re
import time

import grpc
import numpy as np
import pytest
import redis
import tritonclient.grpc as tc
import tritonclient.grpc.aio as tca
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import given, settings
from prometheus_client import REGISTRY
from hypothesis import strategies as st
from tritonclient.utils import InferenceServerException

from batchline import auth, contract
from batchline.errors import PermissionDenied, Unauthenticated
from batchline.testing.auth_files import ADMIN, OTHER, SEARCH, token_entry, write_auth_file
from batchline.testing.polling import poll

@pytest.fixture
def guarded(mesh_factory, tmp_path):
    path = tmp_path / "auth.toml"
    write_auth_file(path, token_entry(SEARCH, "search", ["ml*"]), token_entry(OTHER, "other", ["minilm"]),
           token_entry(ADMIN, "ops", ["*"], admin=True))
    m = mesh_factory(models=["mlp"], gateway_overrides={"auth_file": str(path)})
    return m, path


def _input() -> tc.InferInput:
    return tc.InferInput("features", [1, 32], "FP32").set_data_from_numpy(np.ones((1, 32), np.float32))


def _bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def _counted(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(f"batchline_{name}_total", labels) or 0.0


def _status_of(call) -> str:
    with pytest.raises(InferenceServerException) as info:
        call()
    return info.value.status()


def test_tokens_in_scope_work_with_sync_aio_and_streaming_clients(guarded):
    m, _ = guarded
    with tc.InferenceServerClient(m.address) as client:
        assert client.infer("mlp", [_input()], headers=_bearer(SEARCH)).as_numpy("probability").shape == (1, 1)
        assert client.get_model_metadata("mlp", headers=_bearer(SEARCH)).name == "mlp"
        answers: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: answers.put((result, error)), headers=_bearer(SEARCH))
        client.async_stream_infer("mlp", [_input()], request_id="s1")
        result, error = answers.get(timeout=30)
        assert error is None and result.as_numpy("probability").shape == (1, 1)
        # On the same stream, a model outside the token's scope: that request alone is refused.
        client.async_stream_infer("minilm", [_input()], request_id="s2")
        _, error = answers.get(timeout=30)
        client.stop_stream()
        assert error is not None and "[PERMISSION_DENIED] tenant 'search' may not call model 'minilm'" in str(error)

    async def aio():
        async with tca.InferenceServerClient(m.address) as client:
            return await client.infer("mlp", [_input()], headers=_bearer(SEARCH))

    assert asyncio.run(aio()).as_numpy("probability").shape == (1, 1)


def test_a_stream_judges_every_message_by_the_auth_file_as_it_is_then(guarded):
    m, path = guarded
    answers: queue.Queue = queue.Queue()

    def send(client, request_id: str) -> str:
        client.async_stream_infer("mlp", [_input()], request_id=request_id)
        result, error = answers.get(timeout=30)
        return "OK" if error is None else str(error)

    with tc.InferenceServerClient(m.address) as client:
        client.start_stream(callback=lambda result, error: answers.put((result, error)), headers=_bearer(SEARCH))
        assert send(client, "before") == "OK"
        # The token's scope narrowed while the stream is open: the next message is judged by it.
        write_auth_file(path, token_entry(SEARCH, "search", ["minilm"]), token_entry(OTHER, "other", ["minilm"]))
        assert "[PERMISSION_DENIED] tenant 'search' may not call model 'mlp'" in send(client, "narrowed")
        write_auth_file(path, token_entry(SEARCH, "search", ["ml*"]).replace("max_rate = 0", "max_rate = 1"))
        assert send(client, "widened") == "OK"
        # A cap added mid-stream: its bucket of one is spent by the first message.
        assert "[RESOURCE_EXHAUSTED] tenant 'search' is over its rate of 1 requests/s" in send(client, "capped")
        # Revoked: removed from the file, refused from the next message on the same stream.
        write_auth_file(path, token_entry(OTHER, "other", ["minilm"]))
        assert "[UNAUTHENTICATED] the token is not known to this gateway" in send(client, "revoked")
        client.stop_stream()


def test_bad_credentials_get_their_status_and_never_reach_redis(guarded):
    m, path = guarded
    r = redis.Redis.from_url(m.redis_url)
    r.set(contract.LEADER, "held-by-the-test", px=120_000)  # anything admitted would stay queued
    poll(lambda: not m.scheduler.scheduler.leader, 15, "the scheduler to stand by")
    statuses = {}
    with tc.InferenceServerClient(m.address) as client:
        infer = lambda **kw: client.infer("mlp", [_input()], client_timeout=10, **kw)  # noqa: E731
        statuses["no token"] = _status_of(infer)
        statuses["wrong token"] = _status_of(lambda: infer(headers=_bearer("not-a-token")))
        statuses["not a bearer token"] = _status_of(lambda: infer(headers={"authorization": "Basic abc"}))
        statuses["another model's token"] = _status_of(lambda: infer(headers=_bearer(OTHER)))
        statuses["statistics without admin"] = _status_of(
            lambda: client.get_inference_statistics("mlp", headers=_bearer(SEARCH)))
        # Revoked: the file is rewritten without the token; the next request finds it changed.
        write_auth_file(path, token_entry(OTHER, "other", ["minilm"]))
        statuses["revoked token"] = _status_of(lambda: infer(headers=_bearer(SEARCH)))
        # Probes stay open.
        assert client.is_server_live()
    assert statuses == {
        "no token": "StatusCode.UNAUTHENTICATED", "wrong token": "StatusCode.UNAUTHENTICATED",
        "not a bearer token": "StatusCode.UNAUTHENTICATED", "another model's token": "StatusCode.PERMISSION_DENIED",
        "statistics without admin": "StatusCode.PERMISSION_DENIED", "revoked token": "StatusCode.UNAUTHENTICATED",
    }
    with grpc.insecure_channel(m.address) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    # Nothing was queued, no payload written: the refusals happened before the gateway touched Redis.
    assert r.zcard(contract.queue(("mlp", "1"))) == 0 and not list(r.scan_iter(contract.payload(("*", "*"), "*")))
    r.delete(contract.LEADER)


def test_two_authorization_headers_are_refused_whichever_they_name(guarded):
    """Which of two tokens would count differs between a proxy that adds one, gRPC and HTTP: a call
    with more than one is refused, even when both are valid."""
    from batchline.protocol import inference_pb2 as ipb
    from batchline.protocol import inference_pb2_grpc

    m, _ = guarded
    request = ipb.ModelInferRequest(model_name="mlp")
    with grpc.insecure_channel(m.address) as channel:
        stub = inference_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(request, timeout=10, metadata=[("authorization", f"Bearer {SEARCH}"),
                                                           ("authorization", f"Bearer {SEARCH}")])
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "carries 2 `authorization` headers: send one" in info.value.details()


def test_a_refusal_names_no_model_outside_the_tokens_scope(guarded):
    m, _ = guarded
    with tc.InferenceServerClient(m.address) as client:
        # minilm is in OTHER's scope but served by nobody: NOT_FOUND, and mlp, served but outside
        # the scope, goes unnamed (an admin's refusal names it).
        for call in (lambda token: client.infer("minilm", [_input()], headers=_bearer(token)),
                     lambda token: client.get_model_metadata("minilm", headers=_bearer(token)),
                     lambda token: client.get_model_config("minilm", headers=_bearer(token))):
            with pytest.raises(InferenceServerException) as info:
                call(OTHER)
            assert info.value.status() == "StatusCode.NOT_FOUND" and "(served models: none)" in info.value.message()
            with pytest.raises(InferenceServerException) as info:
                call(ADMIN)
            assert "(served models: mlp)" in info.value.message()
        # An empty name is judged by the scope like any other: no scope holds it.
        denied = "StatusCode.PERMISSION_DENIED"
        assert _status_of(lambda: client.infer("", [_input()], headers=_bearer(OTHER))) == denied
        assert _status_of(lambda: client.get_model_metadata("", headers=_bearer(SEARCH))) == denied
        # A version that is no number is the caller's mistake, not the server's.
        assert _status_of(lambda: client.is_model_ready("mlp", "abc", headers=_bearer(SEARCH))) == \
            "StatusCode.INVALID_ARGUMENT"


def test_an_admin_token_reads_statistics(guarded):
    m, _ = guarded
    with tc.InferenceServerClient(m.address) as client:
        stats = client.get_inference_statistics("mlp", headers=_bearer(ADMIN))
    assert [s.name for s in stats.model_stats] == ["mlp"]


def test_statistics_show_an_admin_only_the_models_in_its_scope(guarded):
    m, path = guarded
    scoped = "scoped-admin-token"
    write_auth_file(path, token_entry(ADMIN, "ops", ["*"], admin=True),
                    token_entry(scoped, "ops-minilm", ["minilm*"], admin=True))
    with tc.InferenceServerClient(m.address) as client:
        assert [s.name for s in client.get_inference_statistics("", headers=_bearer(ADMIN)).model_stats] == ["mlp"]
        assert list(client.get_inference_statistics("", headers=_bearer(scoped)).model_stats) == []
        assert _status_of(lambda: client.get_inference_statistics("mlp", headers=_bearer(scoped))) == \
            "StatusCode.PERMISSION_DENIED"
    import tritonclient.http as th

    with th.InferenceServerClient(m.http_address) as client:
        assert client.get_inference_statistics("", headers=_bearer(scoped))["model_stats"] == []
        with pytest.raises(InferenceServerException) as denied:
            client.get_inference_statistics("mlp", headers=_bearer(scoped))
        assert "may not call model 'mlp'" in denied.value.message()


def test_a_stream_with_an_unknown_token_is_refused_when_it_opens(guarded):
    m, _ = guarded
    channel = grpc.insecure_channel(m.address)
    try:
        from batchline.protocol import inference_pb2_grpc

        stub = inference_pb2_grpc.GRPCInferenceServiceStub(channel)
        # No message sent: the stream itself is ended, not left open to answer each message.
        stream = stub.ModelStreamInfer(iter(()), metadata=(("authorization", "Bearer junk"),), timeout=10)
        with pytest.raises(grpc.RpcError) as refused:
            list(stream)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        channel.close()


def test_the_repository_shows_a_token_only_its_models_and_takes_loads_only_from_admins(guarded):
    m, _ = guarded
    with tc.InferenceServerClient(m.address) as client:
        def index(token):
            return [(e.name, e.state) for e in client.get_model_repository_index(headers=_bearer(token)).models]

        assert index(SEARCH) == index(ADMIN) == [("mlp", "READY")]
        assert index(OTHER) == []  # mlp is outside its scope: not even named
        assert _status_of(lambda: client.load_model("mlp", headers=_bearer(SEARCH))) == "StatusCode.PERMISSION_DENIED"
        assert _status_of(lambda: client.unload_model("mlp", headers=_bearer(OTHER))) == "StatusCode.PERMISSION_DENIED"
        assert _status_of(lambda: client.get_model_repository_index()) == "StatusCode.UNAUTHENTICATED"
        # An admin passes; this mesh is not in explicit mode, which is what refuses it.
        assert _status_of(lambda: client.load_model("mlp", headers=_bearer(ADMIN))) == "StatusCode.UNAVAILABLE"


def test_a_model_outside_the_scope_is_refused_whether_it_exists_or_not(tmp_path):
    path = tmp_path / "auth.toml"
    write_auth_file(path, token_entry(SEARCH, "search", ["ml*"]))
    grant = auth.Tokens(str(path)).grant([("authorization", f"Bearer {SEARCH}")])
    grant.check_model("mlp")
    for name in ("minilm", "does-not-exist"):
        with pytest.raises(PermissionDenied) as info:
            grant.check_model(name)
        assert str(info.value) == f"tenant 'search' may not call model '{name}'"
    assert SEARCH not in repr(grant) and hashlib.sha256(SEARCH.encode()).hexdigest() not in repr(grant)


@pytest.mark.parametrize("text, says", [
    ("tokens = 3", "array of tables"),
    ('[[tokens]]\nsha256 = "abc"\ntenant = "t"', "64 hex digits"),
    (f'[[tokens]]\nsha256 = "{"a" * 64}"\ntenant = ""', "`tenant`"),
    (f'[[tokens]]\nsha256 = "{"a" * 64}"\ntenant = "t"\nmodels = "mlp"', "`models`"),
    (f'[[tokens]]\nsha256 = "{"a" * 64}"\ntenant = "t"\nweight = -1', "`weight`"),
    (f'[[tokens]]\nsha256 = "{"a" * 64}"\ntenant = "t"\ncolour = 1', "unknown field"),
    (f'[[tokens]]\nsha256 = "{"a" * 64}"\ntenant = "t"\n[[tokens]]\nsha256 = "{"A" * 64}"\ntenant = "u"', "twice"),
    ("[[tokens]\n", "not valid TOML"),
])
def test_an_auth_file_that_cannot_be_used_says_where(text, says):
    with pytest.raises(auth.AuthFileError) as info:
        auth.parse(text, "auth.toml")
    assert says in str(info.value) and "auth.toml" in str(info.value)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200))
def test_any_auth_file_text_parses_or_is_an_auth_file_error(text):
    try:
        auth.parse(text)
    except auth.AuthFileError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=100), st.binary(max_size=100)))
def test_any_authorization_header_is_unauthenticated_or_a_grant(tmp_path_factory, value):
    path = tmp_path_factory.mktemp("auth") / "auth.toml"
    write_auth_file(path, token_entry(SEARCH, "search", ["mlp"]))
    tokens = auth.Tokens(str(path))
    try:
        tokens.grant([("authorization", value)])
    except Unauthenticated:
        pass


def test_a_tenants_max_rate_is_one_bucket_across_gateways(mesh_factory, tmp_path):
    from gateway.app import GatewayApp
    from gateway.settings import GatewaySettings

    path = tmp_path / "auth.toml"
    write_auth_file(path, token_entry(SEARCH, "search", ["mlp"]).replace("max_rate = 0", "max_rate = 2"))
    m = mesh_factory(models=["mlp"], gateway_overrides={"auth_file": str(path)})
    second = m.call(GatewayApp(GatewaySettings(redis_url=m.redis_url, port=0, metrics_port=-1, http_port=-1,
                                               auth_file=str(path))).start())
    outcomes, messages = [], []
    tenant_before = _counted("tenant_requests", model="mlp", tenant="search", status="resource_exhausted")
    failures_before = _counted("request_failure", model="mlp", version="1", reason="resource_exhausted")
    try:
        started = time.monotonic()
        for i in range(12):  # alternating between the two gateways
            address = m.address if i % 2 == 0 else second.address
            with tc.InferenceServerClient(address) as client:
                try:
                    client.infer("mlp", [_input()], headers=_bearer(SEARCH))
                    outcomes.append("OK")
                except InferenceServerException as exc:
                    outcomes.append(exc.status())
                    messages.append(exc.message())
        elapsed = time.monotonic() - started
    finally:
        m.call(second.stop(0))
    # A bucket of 2, refilled at 2 a second, shared: no more than that got through, both gateways together.
    assert outcomes.count("OK") <= 2 + 2 * elapsed + 1e-9, (outcomes, elapsed)
    assert set(outcomes) == {"OK", "StatusCode.RESOURCE_EXHAUSTED"}, outcomes
    assert all(re.search(r"tenant 'search' is over its rate of 2 requests/s: retry in \d+ ms", x) for x in messages)
    # The cap's refusals are counted where every refusal is: both gateways run in this process.
    refused = outcomes.count("StatusCode.RESOURCE_EXHAUSTED")
    assert _counted("tenant_requests", model="mlp", tenant="search",
                    status="resource_exhausted") - tenant_before == refused
    assert _counted("request_failure", model="mlp", version="1",
                    reason="resource_exhausted") - failures_before == refused


def test_a_token_swapped_in_place_with_its_time_kept_is_revoked(tmp_path):
    """One token's hash swapped for another's (the same size) and the modification time kept, as
    `cp -p` or `rsync -t` keep it: the change is still seen, and the old token refused."""
    import os

    path = tmp_path / "auth.toml"
    path.write_text(token_entry(SEARCH, "search", ["ml*"]))
    tokens = auth.Tokens(str(path))
    old = hashlib.sha256(SEARCH.encode()).hexdigest()
    assert tokens.lookup(old).tenant == "search"
    before = os.stat(path)
    new_token = "b" * len(SEARCH)
    with open(path, "r+") as f:  # in place: the same file, the same size
        f.write(token_entry(new_token, "search", ["ml*"]))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert os.stat(path).st_size == before.st_size and os.stat(path).st_mtime_ns == before.st_mtime_ns
    with pytest.raises(Unauthenticated):
        tokens.lookup(old)
    assert tokens.lookup(hashlib.sha256(new_token.encode()).hexdigest()).tenant == "search"


def test_an_auth_file_that_became_unusable_keeps_its_tokens_and_says_so(tmp_path):
    """A file mid-edit that does not parse keeps the tokens read before (a gateway must not lock
    everyone out): a gauge says so while it lasts, for an alert, since a revocation in that change
    is not in force yet."""
    path = tmp_path / "auth.toml"
    path.write_text(token_entry(SEARCH, "search", ["ml*"]))
    tokens = auth.Tokens(str(path))
    digest = hashlib.sha256(SEARCH.encode()).hexdigest()
    path.write_text("[[token]\nnot toml")
    assert tokens.lookup(digest).tenant == "search"
    assert REGISTRY.get_sample_value("batchline_auth_file_unusable") == 1
    path.write_text(token_entry(SEARCH, "search", ["ml*"]) + "\n")
    assert tokens.lookup(digest).tenant == "search"
    assert REGISTRY.get_sample_value("batchline_auth_file_unusable") == 0
