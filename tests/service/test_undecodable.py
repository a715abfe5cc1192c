"""Bytes that are no valid request message: INVALID_ARGUMENT naming the method and the message type,
on every method a service serves (gRPC alone answers UNKNOWN "Unexpected <class DecodeError>"),
and on a stream an error for that message alone, the stream going on."""
from __future__ import annotations

import grpc
import numpy as np
import pytest

from batchline.protocol import inference_pb2 as ipb
from batchline.protocol import inference_pb2_grpc  # noqa: F401  (registers the service's descriptor)
from batchline.protocol._pool import POOL

# A field 1 length prefix that runs past the end: no message parses it.
GARBAGE = b"\x0a\xff\xff\xff\x0f"


def _raw(channel: grpc.Channel, method: str, client_streams: bool, server_streams: bool):
    kind = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
            (True, False): channel.stream_unary, (True, True): channel.stream_stream}[(client_streams, server_streams)]
    return kind(method)  # no serializers: the bytes go as they are


def _methods():
    service = POOL.FindServiceByName("inference.GRPCInferenceService")
    found = [(f"/{service.full_name}/{m.name}", m.input_type.full_name, m.client_streaming, m.server_streaming)
             for m in service.methods if m.name != "ModelStreamInfer"]  # answers each message: the test below
    return found + [("/grpc.health.v1.Health/Check", "grpc.health.v1.HealthCheckRequest", False, False),
                    ("/grpc.health.v1.Health/Watch", "grpc.health.v1.HealthCheckRequest", False, True),
                    ("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                     "grpc.reflection.v1alpha.ServerReflectionRequest", True, True)]


@pytest.mark.parametrize("method, message_type, client_streams, server_streams", _methods())
def test_undecodable_bytes_are_invalid_argument_naming_the_method(mesh, method, message_type,
                                                                   client_streams, server_streams):
    with grpc.insecure_channel(mesh.address) as channel:
        call = _raw(channel, method, client_streams, server_streams)
        request = iter([GARBAGE]) if client_streams else GARBAGE
        with pytest.raises(grpc.RpcError) as info:
            answer = call(request, timeout=10)
            if server_streams:
                list(answer)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert info.value.details().startswith(f"{method}: the request's bytes are not a valid {message_type} message")


def test_an_undecodable_message_on_a_stream_is_answered_alone_and_the_stream_goes_on(mesh):
    def good(request_id: str) -> bytes:
        request = ipb.ModelInferRequest(model_name="mlp", id=request_id)
        tensor = request.inputs.add(name="features", datatype="FP32", shape=[1, 32])
        tensor.contents.fp32_contents.extend(np.ones(32, np.float32).tolist())
        return request.SerializeToString()

    def messages():
        yield good("good-1")
        yield GARBAGE
        yield good("good-2")

    with grpc.insecure_channel(mesh.address) as channel:
        stream = _raw(channel, "/inference.GRPCInferenceService/ModelStreamInfer", True, True)
        answers = [ipb.ModelStreamInferResponse.FromString(raw) for raw in stream(messages(), timeout=30)]
    assert sorted(a.infer_response.id for a in answers if not a.error_message) == ["good-1", "good-2"]
    errors = [a.error_message for a in answers if a.error_message]
    assert len(errors) == 1 and errors[0].startswith(
        "[INVALID_ARGUMENT] /inference.GRPCInferenceService/ModelStreamInfer: the request's bytes are not a valid "
        "inference.ModelInferRequest message (DecodeError: "), errors


def test_paths_no_service_serves_are_not_remembered():
    """A client may name any path: the handlers kept are those of methods served, however many
    others are asked for (each would otherwise hold memory for as long as the server runs)."""
    from batchline.undecodable import _GuardedGeneric

    served = grpc.unary_unary_rpc_method_handler(lambda request, context: request)

    class Inner(grpc.GenericRpcHandler):
        def service(self, details):
            return served if details.method == "/s/Known" else None

    class Details(grpc.HandlerCallDetails):
        def __init__(self, method: str) -> None:
            self.method, self.invocation_metadata = method, ()

    generic = _GuardedGeneric(Inner())
    for i in range(1000):
        assert generic.service(Details(f"/x/{i}")) is None
    assert generic.service(Details("/s/Known")) is not None
    assert list(generic.handlers) == ["/s/Known"]
