"""The checked-in stubs are what scripts/gen_protos.py generates from protos/, and they are wire-compatible with
Triton."""
from __future__ import annotations

import importlib.util

import pytest
from google.protobuf import descriptor_pool
from tritonclient.grpc import model_config_pb2, service_pb2 as triton

from batchline.protocol import inference_pb2
from batchline.testing.checkout import ROOT


def _gen():
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_checked_in_stubs_are_fresh(tmp_path):
    written = _gen().generate(tmp_path)
    assert written
    for path in written:
        rel = path.relative_to(tmp_path)
        checked_in = ROOT / rel
        assert checked_in.exists(), f"{rel} is not checked in: run python scripts/gen_protos.py"
        assert checked_in.read_text() == path.read_text(), f"{rel} is stale: run python scripts/gen_protos.py"


def _fields(descriptor):
    out = {}
    for f in descriptor.fields:
        sub = f.message_type
        out[f.name] = (f.number, f.type, f.is_repeated, sub.full_name if sub is not None else None)
    return out


@pytest.mark.parametrize("message", sorted(inference_pb2.DESCRIPTOR.message_types_by_name))
def test_messages_match_triton_field_for_field(message):
    ours = inference_pb2.DESCRIPTOR.message_types_by_name[message]
    # Triton keeps ModelConfig and its parts in model_config.proto, the rest in grpc_service.proto.
    theirs = descriptor_pool.Default().FindMessageTypeByName(f"inference.{message}")
    assert ours.full_name == theirs.full_name
    mine, triton_fields = _fields(ours), _fields(theirs)
    # Every field we declare exists in Triton's with the same number and type;
    # Triton may have more (newer additions) that we do not use.
    for name, spec in mine.items():
        assert triton_fields.get(name) == spec, f"{message}.{name}: ours {spec}, Triton {triton_fields.get(name)}"
    for nested in ours.nested_types:
        if not nested.GetOptions().map_entry:
            theirs_nested = theirs.nested_types_by_name[nested.name]
            assert _fields(nested).items() <= _fields(theirs_nested).items()
    for enum in ours.enum_types:
        assert _values(enum).items() <= _values(theirs.enum_types_by_name[enum.name]).items()


def _values(enum) -> dict[str, int]:
    return {v.name: v.number for v in enum.values}


@pytest.mark.parametrize("enum", sorted(inference_pb2.DESCRIPTOR.enum_types_by_name))
def test_enums_match_triton(enum):
    assert model_config_pb2.DESCRIPTOR.enum_types_by_name[enum].full_name == f"inference.{enum}"
    assert (_values(inference_pb2.DESCRIPTOR.enum_types_by_name[enum])
            == _values(model_config_pb2.DESCRIPTOR.enum_types_by_name[enum]))


def test_service_methods_match_triton():
    ours = inference_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    theirs = triton.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert ours.full_name == theirs.full_name == "inference.GRPCInferenceService"
    for m in ours.methods:
        t = theirs.methods_by_name[m.name]
        assert (m.input_type.full_name, m.output_type.full_name) == (t.input_type.full_name, t.output_type.full_name)
        assert (m.client_streaming, m.server_streaming) == (t.client_streaming, t.server_streaming)
