"""Unit tests for gateway/validation.py's CheckedLayouts: a request laid out like one found valid is
not checked again, and that never changes what a request is answered."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchline.errors import InvalidArgument
from batchline.protocol import inference_pb2 as ipb
from batchline.protocol import internal_pb2 as pb
from batchline.regions import REF, Ref
from gateway.validation import CheckedLayouts, checked


def model(name: str = "pair", max_batch_size: int = 8, datatype: str = "INT64", **fields) -> pb.ModelInfo:
    return pb.ModelInfo(name=name, version="1", max_batch_size=max_batch_size,
                        inputs=[pb.TensorSpec(name="ids", datatype=datatype, shape=[-1, -1]),
                                pb.TensorSpec(name="mask", datatype=datatype, shape=[-1, -1])],
                        outputs=[pb.TensorSpec(name="out", datatype="FP32", shape=[-1, 4])], **fields)


MODELS = [model(), model("flags", datatype="BOOL"), model("texts", datatype="BYTES"),
          model("seq", sequence=pb.SequenceBatching()),
          model("fixed", max_batch_size=0)]


def tensor_request(name: str, shapes: list[list[int]], datatypes: list[str], sizes: list[int], fill: int = 1,
                   outputs: tuple[str, ...] = (), typed: bool = False, parameters: dict | None = None,
                   tensor_parameter: bool = False, names: tuple[str, ...] = ("ids", "mask", "extra"),
                   ) -> ipb.ModelInferRequest:
    req = ipb.ModelInferRequest(model_name=name)
    for input_name, shape, datatype, size in zip(names, shapes, datatypes, sizes):
        t = req.inputs.add(name=input_name, datatype=datatype, shape=shape)
        if tensor_parameter:
            t.parameters[REF].string_param = Ref("region", "key", 1, 0, size).encode()
        if typed:
            t.contents.int64_contents.extend([fill] * max(0, size // 8))
        else:
            req.raw_input_contents.append(bytes([fill]) * size)
    for out in outputs:
        req.outputs.add(name=out)
    for key, value in (parameters or {}).items():
        req.parameters[key].int64_param = value
    return req


def answer(check, req, m) -> tuple[int, int] | str:
    """What checking `req` answers: its facts, or the refusal's message."""
    try:
        return check(req, m)
    except InvalidArgument as exc:
        return str(exc)


# Few shapes and sizes, so that a run sends layouts alike with bytes, outputs or parameters that differ.
shapes = st.sampled_from([[1, 2], [2, 2], [1, -1], [9, 2], [2], [1, 2, 1]])
requests = st.builds(
    tensor_request,
    name=st.sampled_from([m.name for m in MODELS]),
    shapes=st.lists(shapes, min_size=1, max_size=3),
    datatypes=st.lists(st.sampled_from(["INT64", "BOOL", "FP32", "BYTES"]), min_size=3, max_size=3),
    sizes=st.lists(st.sampled_from([2, 8, 16, 32]), min_size=3, max_size=3),
    fill=st.sampled_from([0, 1, 2]),
    outputs=st.sampled_from([(), ("out",), ("nope",)]),
    typed=st.booleans(),
    parameters=st.sampled_from([None, {"timeout": 5}, {"sequence_id": 7}, {"sequence_id": 0},
                                {"sequence_start": 1}]),
    tensor_parameter=st.booleans(),
)


@settings(max_examples=400, deadline=None)
@given(st.lists(requests, min_size=1, max_size=30))
def test_checking_through_the_layouts_answers_every_request_as_checking_it_alone(reqs):
    layouts = CheckedLayouts()
    by_name = {m.name: m for m in MODELS}
    for req in reqs:
        m = by_name[req.model_name]
        assert answer(layouts.facts, req, m) == answer(checked, req, m)


def test_a_request_laid_out_like_a_valid_one_gets_its_facts_and_is_kept_once():
    layouts, m = CheckedLayouts(), model()
    req = tensor_request("pair", [[2, 5], [2, 5]], ["INT64", "INT64"], [80, 80])
    assert layouts.facts(req, m) == (2, 5)
    assert layouts.facts(tensor_request("pair", [[2, 5], [2, 5]], ["INT64", "INT64"], [80, 80], fill=9), m) == (2, 5)
    assert len(layouts) == 1


def test_a_layout_found_invalid_is_not_kept():
    layouts, m = CheckedLayouts(), model()
    short = tensor_request("pair", [[2, 5], [2, 5]], ["INT64", "INT64"], [80, 72])
    for _ in range(2):
        with pytest.raises(InvalidArgument, match="needs 80 bytes, got 72"):
            layouts.facts(short, m)
    assert len(layouts) == 0


@pytest.mark.parametrize("bad, why", [
    (dict(sizes=[80, 72]), "needs 80 bytes, got 72"),
    (dict(outputs=("nope",)), "has no output 'nope'"),
    (dict(datatypes=["INT64", "INT32"]), "must be INT64, got INT32"),
    (dict(names=("ids", "ids")), "missing \\['mask'\\]"),
])
def test_a_layout_that_differs_from_a_valid_one_is_checked(bad, why):
    """The byte counts, the outputs asked for, the datatypes, the names are the layout's: one that differs
    from a layout found valid is checked, and refused when it is wrong."""
    layouts, m = CheckedLayouts(), model()
    good = dict(shapes=[[2, 5], [2, 5]], datatypes=["INT64", "INT64"], sizes=[80, 80], outputs=("out",))
    assert layouts.facts(tensor_request("pair", **good), m) == (2, 5)
    with pytest.raises(InvalidArgument, match=why):
        layouts.facts(tensor_request("pair", **{**good, **bad}), m)


@pytest.mark.parametrize("later, why", [
    (dict(m=model("flags", datatype="BOOL"), fill=2), "BOOL raw bytes must be 0 or 1"),
    (dict(m=model("texts", datatype="BYTES"), fill=1), "declares 16843009 bytes"),
    (dict(m=model("seq", sequence=pb.SequenceBatching()), parameters={"sequence_id": 0}), "correlation ID"),
    (dict(m=model(), parameters={"sequence_id": 7}), "has no sequence batching"),
    (dict(m=model(), region_size=8), "needs 40 bytes, got 8"),
    (dict(m=model(), typed_too=True), "contents field must not be specified"),
])
def test_what_a_layout_does_not_decide_is_checked_every_time(later, why):
    """The same layout, valid once, is refused when what it carries is wrong: the bytes of a BOOL
    input, a sequence model's id, sequence parameters sent to a model without sequences, the region
    a shared-memory reference names, typed contents beside the raw bytes."""
    m = later.pop("m")
    datatypes = [m.inputs[0].datatype] * 2
    width = {"INT64": 40, "BOOL": 5, "BYTES": 20}[datatypes[0]]  # [1, 5] of it (BYTES: five empty ones)
    region_size, typed_too = later.pop("region_size", None), later.pop("typed_too", False)
    layouts = CheckedLayouts()
    first = {"parameters": {"sequence_id": 7}} if m.HasField("sequence") else {}
    good = tensor_request(m.name, [[1, 5], [1, 5]], datatypes, [width, width], fill=0 if width == 20 else 1, **first)
    assert layouts.facts(good, m) == (1, 5)
    bad = tensor_request(m.name, [[1, 5], [1, 5]], datatypes, [width, width], **later)
    if region_size is not None:  # the raw bytes as before, the region a reference names too short
        bad.inputs[1].parameters[REF].string_param = Ref("region", "key", 1, 0, region_size).encode()
    if typed_too:  # the raw bytes as before, and typed contents beside them
        bad.inputs[1].contents.int64_contents.extend([1] * 5)
    with pytest.raises(InvalidArgument, match=why):
        layouts.facts(bad, m)


def test_a_model_read_again_is_checked_again():
    """The registry read again describes the model anew: a layout valid for the old description is
    checked against the new one (here a smaller max_batch_size)."""
    layouts = CheckedLayouts()
    req = tensor_request("pair", [[8, 5], [8, 5]], ["INT64", "INT64"], [320, 320])
    assert layouts.facts(req, model(max_batch_size=8)) == (8, 5)
    with pytest.raises(InvalidArgument, match="batch size 8 is outside 1..4"):
        layouts.facts(req, model(max_batch_size=4))


def test_layouts_kept_are_bounded():
    layouts, m = CheckedLayouts(limit=4), model()
    for length in range(1, 11):
        req = tensor_request("pair", [[1, length], [1, length]], ["INT64", "INT64"], [8 * length] * 2)
        assert layouts.facts(req, m) == (1, length)
        assert len(layouts) <= 4


def test_the_limit_is_checked_on_entry():
    with pytest.raises(ValueError, match="limit must be at least 1, got 0"):
        CheckedLayouts(limit=0)
