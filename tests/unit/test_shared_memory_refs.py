"""Shared-memory regions by reference: the gateway queues a reference in place of a region's bytes
and the executor reads the inputs and writes the outputs itself (real files under /dev/shm), and
the bytes copied in when the executor cannot read the region."""
from __future__ import annotations

import errno
import os
import uuid

import numpy as np
import pytest

from batchline.codec import decode_inputs, encode_array
from batchline.errors import InvalidArgument
from batchline.protocol import inference_pb2 as ipb
from batchline.regions import REF, WRITTEN, RegionUnreadable, host_id
from executor import shared_memory as executor_shm
from batchline.protocol import internal_pb2 as pb
from gateway.shared_memory import SharedMemory
from gateway.validation import validate

MODEL = pb.ModelInfo(name="m", version="1", max_batch_size=8,
                     inputs=[pb.TensorSpec(name="INPUT0", datatype="FP32", shape=[-1, -1])],
                     outputs=[pb.TensorSpec(name="OUTPUT0", datatype="FP32", shape=[-1, -1])])


@pytest.fixture
def region_file():
    name = f"bl_unit_{uuid.uuid4().hex[:8]}"
    path = f"/dev/shm/{name}"
    with open(path, "wb") as f:
        f.write(b"\0" * 1024)
    yield name, path
    if os.path.exists(path):
        os.unlink(path)


def _request(data: np.ndarray, names: tuple[str, ...] = ("INPUT0",)) -> ipb.ModelInferRequest:
    """`data` in the region "r" at offset 0; the output OUTPUT0 wanted in it at offset 512."""
    request = ipb.ModelInferRequest(model_name="m")
    for name in names:
        tensor = request.inputs.add(name=name, datatype="FP32", shape=list(data.shape))
        tensor.parameters["shared_memory_region"].string_param = "r"
        tensor.parameters["shared_memory_byte_size"].int64_param = data.nbytes
    out = request.outputs.add(name="OUTPUT0")
    out.parameters["shared_memory_region"].string_param = "r"
    out.parameters["shared_memory_byte_size"].int64_param = 512
    out.parameters["shared_memory_offset"].int64_param = 512
    return request


def _answer(request: ipb.ModelInferRequest, array: np.ndarray) -> ipb.ModelInferResponse:
    """What an executor answers, its outputs written into their regions where the request references them."""
    response = ipb.ModelInferResponse(model_name="m")
    datatype, shape, raw = encode_array(array)
    response.outputs.add(name="OUTPUT0", datatype=datatype, shape=shape)
    response.raw_output_contents.append(raw)
    executor_shm.write_outputs(request, response)
    return response


def test_the_host_is_known_here():
    assert host_id().count(":") >= 1  # boot id and /dev/shm's device: references are possible here


def test_the_executor_reads_and_writes_a_referenced_region_as_the_copy_would(region_file):
    name, path = region_file
    data = np.arange(32, dtype=np.float32).reshape(1, 32)
    with open(path, "r+b") as f:
        f.write(data.tobytes())
    regions = SharedMemory()
    regions.register("r", f"/{name}", 0, 1024)
    try:
        request = _request(data)
        targets = regions.output_targets(request)
        queued, payload, copied = regions.read_inputs(request, "", targets, by_reference=True)
        assert copied is not None and data.tobytes() not in payload  # a reference, not the bytes
        assert list(queued.raw_input_contents) == [b""]
        assert validate(queued, MODEL) == 1  # the sizes of what it references check out
        assert REF in queued.inputs[0].parameters and REF in queued.outputs[0].parameters
        arrays = decode_inputs(queued, executor_shm.read_inputs(queued))
        copy_request, copy_payload = copied()
        assert REF not in copy_request.inputs[0].parameters and REF not in copy_request.outputs[0].parameters
        assert copy_request.raw_input_contents[0] == data.tobytes()
        assert np.array_equal(arrays["INPUT0"], decode_inputs(copy_request)["INPUT0"])

        response = _answer(queued, arrays["INPUT0"] * 2)
        assert list(response.raw_output_contents) == [b""]
        assert response.outputs[0].parameters[WRITTEN].int64_param == data.nbytes
        SharedMemory.write_outputs(response, targets)  # the gateway: the answer says where it is
        params = response.outputs[0].parameters
        assert WRITTEN not in params and params["shared_memory_region"].string_param == "r"
        assert (params["shared_memory_offset"].int64_param, params["shared_memory_byte_size"].int64_param) == (
            512, data.nbytes)
        with open(path, "rb") as f:
            f.seek(512)
            assert f.read(data.nbytes) == (data * 2).tobytes()
    finally:
        regions.close()


def test_a_key_that_names_another_file_now_is_unreadable_and_the_copy_has_the_registered_bytes(region_file):
    name, path = region_file
    data = np.full((1, 8), 7, dtype=np.float32)
    with open(path, "r+b") as f:
        f.write(data.tobytes())
    regions = SharedMemory()
    regions.register("r", f"/{name}", 0, 1024)
    try:
        queued, _, copied = regions.read_inputs(_request(data), "", {}, by_reference=True)
        os.unlink(path)  # the client removes its file and makes another under the key
        with open(path, "wb") as f:
            f.write(b"\1" * 1024)
        with pytest.raises(RegionUnreadable, match="'r': key .* is another file here"):
            executor_shm.read_inputs(queued)
        os.unlink(path)
        with pytest.raises(RegionUnreadable, match="'r' .* cannot be opened here"):
            executor_shm.read_inputs(queued)
        assert copied is not None and copied()[0].raw_input_contents[0] == data.tobytes()
    finally:
        regions.close()


def test_a_region_shrunk_under_the_executor_is_refused_not_a_crash(region_file):
    name, path = region_file
    regions = SharedMemory()
    regions.register("r", f"/{name}", 0, 1024)
    try:
        request = _request(np.zeros((1, 64), dtype=np.float32))
        targets = regions.output_targets(request)
        queued, _, _ = regions.read_inputs(request, "", targets, by_reference=True)
        os.truncate(path, 100)
        with pytest.raises(InvalidArgument, match="input 'INPUT0': shared memory region 'r' shrank below 256 bytes"):
            executor_shm.read_inputs(queued)
        with pytest.raises(InvalidArgument, match="output 'OUTPUT0': shared memory region 'r' shrank below 768"):
            _answer(queued, np.zeros((1, 64), dtype=np.float32))
        with pytest.raises(InvalidArgument, match="should be at least 1024 bytes to hold the results"):
            _answer(queued, np.zeros((1, 256), dtype=np.float32))
        with pytest.raises(InvalidArgument, match="input 'INPUT0': shared memory region 'r' shrank below 256"):
            regions.read_inputs(_request(np.zeros((1, 64), dtype=np.float32)))
    finally:
        regions.close()


def test_a_reference_checks_sizes_as_the_bytes_would_and_a_client_cannot_send_one(region_file):
    name, _ = region_file
    regions = SharedMemory()
    regions.register("r", f"/{name}", 0, 1024)
    try:
        request = _request(np.zeros((1, 8), dtype=np.float32))
        request.inputs[0].shape[1] = 9  # 36 bytes wanted, 32 in the region's span
        queued, _, _ = regions.read_inputs(request, "", {}, by_reference=True)
        with pytest.raises(InvalidArgument, match="FP32 shape \\[1, 9\\] needs 36 bytes, got 32"):
            validate(queued, MODEL)
        queued.inputs[0].datatype = "INT32"
        with pytest.raises(InvalidArgument, match="must be FP32, got INT32"):  # as for the bytes: the type first
            validate(queued, MODEL)
        forged = ipb.ModelInferRequest(model_name="m")
        forged.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 8]).parameters[REF].string_param = "[]"
        with pytest.raises(InvalidArgument, match=f"'{REF}' is batchline's own"):
            regions.read_inputs(forged)
        forged = ipb.ModelInferRequest(model_name="m")
        forged.outputs.add(name="OUTPUT0").parameters[REF].string_param = "[]"
        with pytest.raises(InvalidArgument, match=f"output 'OUTPUT0': parameter '{REF}'"):
            regions.output_targets(forged)
    finally:
        regions.close()


def test_bytes_inputs_are_copied_even_by_reference(region_file):
    name, path = region_file
    with open(path, "r+b") as f:
        f.write(b"\3\0\0\0abc")
    regions = SharedMemory()
    regions.register("r", f"/{name}", 0, 1024)
    try:
        request = ipb.ModelInferRequest(model_name="m")
        tensor = request.inputs.add(name="TEXT", datatype="BYTES", shape=[1])
        tensor.parameters["shared_memory_region"].string_param = "r"
        tensor.parameters["shared_memory_byte_size"].int64_param = 7
        queued, _, _ = regions.read_inputs(request, "", {}, by_reference=True)
        assert REF not in queued.inputs[0].parameters and queued.raw_input_contents[0] == b"\3\0\0\0abc"
    finally:
        regions.close()


def test_a_key_that_is_a_symbolic_link_is_refused_not_followed(region_file, tmp_path):
    name, path = region_file
    elsewhere = tmp_path / "not_shared_memory"
    elsewhere.write_bytes(b"secret" * 100)
    link = f"/dev/shm/{name}_link"
    os.symlink(elsewhere, link)
    try:
        regions = SharedMemory()
        with pytest.raises(InvalidArgument, match="unable to open shared memory key"):
            regions.register("r", f"/{name}_link", 0, 64)
        regions.register("r", f"/{name}", 0, 1024)
        try:
            data = np.zeros((1, 8), dtype=np.float32)
            queued, _, _ = regions.read_inputs(_request(data), "", {}, by_reference=True)
            os.unlink(path)  # the key now a link to the file elsewhere: the executor must not read it
            os.symlink(elsewhere, path)
            with pytest.raises(RegionUnreadable, match="cannot be opened here"):
                executor_shm.read_inputs(queued)
        finally:
            regions.close()
    finally:
        os.unlink(link)


def test_inputs_copied_from_regions_past_the_message_cap_are_refused_and_by_reference_are_not(region_file):
    from batchline.errors import ResourceExhausted

    name, _ = region_file
    regions = SharedMemory(max_copy_bytes=256)  # a message of 256 bytes at most
    regions.register("r", f"/{name}", 0, 1024)
    try:
        data = np.zeros((1, 100), dtype=np.float32)  # 400 bytes in the region
        with pytest.raises(ResourceExhausted, match="over the gateway's max_message_bytes of 256"):
            regions.read_inputs(_request(data), "", {}, by_reference=False)
        # By reference only the reference travels; copying it later, should the executor not read the
        # region, meets the same cap.
        queued, _, copied = regions.read_inputs(_request(data), "", {}, by_reference=True)
        assert REF in queued.inputs[0].parameters
        with pytest.raises(ResourceExhausted, match="max_message_bytes"):
            copied()
    finally:
        regions.close()


def test_a_tenant_cannot_register_another_tenants_memory_nor_hold_files_without_bound(region_file, monkeypatch):
    import gateway.shared_memory as gateway_shm
    from batchline.errors import ResourceExhausted

    name, _ = region_file
    regions = SharedMemory()
    try:
        regions.register("mine", f"/{name}", 0, 1024, tenant="a")
        # Tenant b, under any region name: its inputs would be a's bytes, its outputs written over them.
        with pytest.raises(InvalidArgument, match="unable to open shared memory key"):
            regions.register("x", f"/{name}", 0, 64, tenant="b")
        regions.register("again", f"/{name}", 0, 64, tenant="a")  # a's own, twice: as Triton allows
        # A NUL in a key is a key that is no shm_open name, not a server error.
        with pytest.raises(InvalidArgument, match="not a shm_open name"):
            regions.register("nul", "/a\0b", 0, 64, tenant="a")
        monkeypatch.setattr(gateway_shm, "MAX_REGIONS", 2)
        with pytest.raises(ResourceExhausted, match="2 regions are registered already"):
            regions.register("third", f"/{name}", 0, 64, tenant="a")
    finally:
        regions.close()


def test_a_tenants_file_stays_its_own_on_every_gateway_of_the_host_and_after_it_unregisters(region_file):
    """Two gateways of one host (batchline up --gateways 2: a client lands on either): a file one
    tenant registered on the first is refused to another tenant on the second, and still once the
    first tenant unregistered it (the file is still its memory); a file of its own is taken."""
    import uuid

    from gateway.shared_memory import OWNER_XATTR

    name, path = region_file
    try:
        os.getxattr(path, OWNER_XATTR)
    except OSError as exc:
        if exc.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
            pytest.skip("this /dev/shm takes no user extended attributes (tmpfs before Linux 6.6)")
    first, second = SharedMemory(), SharedMemory()
    other = f"bl_unit_{uuid.uuid4().hex[:8]}"
    with open(f"/dev/shm/{other}", "wb") as f:
        f.write(bytes(64))
    try:
        # A registration refused for its sizes claims nothing: b's own later, proper one would be refused.
        with pytest.raises(InvalidArgument, match="does not fit key"):
            second.register("x", f"/{name}", 0, 0, tenant="b")
        first.register("in", f"/{name}", 0, 1024, tenant="a")
        with pytest.raises(InvalidArgument, match="unable to open shared memory key"):
            second.register("x", f"/{name}", 0, 64, tenant="b")
        first.unregister("in", tenant="a")
        with pytest.raises(InvalidArgument, match="unable to open shared memory key"):
            second.register("x", f"/{name}", 0, 64, tenant="b")
        second.register("again", f"/{name}", 0, 64, tenant="a")  # its owner, on either gateway
        second.register("x", f"/{other}", 0, 64, tenant="b")
    finally:
        first.close()
        second.close()
        os.unlink(f"/dev/shm/{other}")


def test_the_regions_of_every_tenant_together_keep_within_the_gateways_open_files():
    """Many tenants, each under its own cap, must not take every file descriptor the gateway's
    connections need: the regions of all of them are capped at half its limit of open files."""
    import resource

    from batchline.errors import ResourceExhausted
    from gateway.shared_memory import open_files_for_regions

    assert open_files_for_regions() == resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 2
    names = [f"bl_cap_{uuid.uuid4().hex[:8]}" for _ in range(4)]
    for name in names:
        with open(f"/dev/shm/{name}", "wb") as f:
            f.write(bytes(64))
    regions = SharedMemory(max_open=3)
    try:
        for tenant, name in zip("abc", names):
            regions.register("r", f"/{name}", 0, 64, tenant=tenant)
        with pytest.raises(ResourceExhausted, match=r"as many region files open as it may \(3\)"):
            regions.register("r", f"/{names[3]}", 0, 64, tenant="d")
        regions.unregister("r", tenant="b")
        regions.register("r", f"/{names[3]}", 0, 64, tenant="d")  # room again once one is closed
    finally:
        regions.close()
        for name in names:
            os.unlink(f"/dev/shm/{name}")


def test_outputs_go_into_regions_only_while_the_request_is_awaited(redis_server):
    """A request answered at its deadline (or given up) meanwhile: its client may be using the
    region again for its retry, and the late run's outputs must not land in it."""
    import asyncio

    from batchline import contract
    from batchline.contract.executor_store import ExecutorStore
    from batchline.redis_client import connect, connect_sync
    from batchline.regions import REF as REF_PARAM
    from executor.batch_worker import BatchWorker
    from executor.running import Member

    def member(request_id: str) -> Member:
        m = Member(pb.QueueEntry(request_id=request_id, deadline_us=1))  # run past its deadline
        m.request = ipb.ModelInferRequest(model_name="m")
        m.request.outputs.add(name="OUTPUT0").parameters[REF_PARAM].string_param = "a reference"
        m.outputs = {"OUTPUT0": np.zeros((1, 2), np.float32)}
        return m

    r = connect_sync(redis_server.url, 2)
    r.set(contract.payload(("m", "1"), "awaited"), b"x", px=60_000)
    members = [member("awaited"), member("answered"), member("in time")]
    members[2].entry.deadline_us = 2**62

    async def run() -> None:
        worker = BatchWorker.__new__(BatchWorker)
        worker.store = ExecutorStore(connect(redis_server.url, 2))
        try:
            await worker._drop_unawaited_region_writes(pb.Batch(model_name="m", model_version="1"), members)
        finally:
            await worker.store.aclose()

    asyncio.run(run())
    r.close()
    assert members[0].outputs is not None and members[0].error is None
    assert members[1].outputs is None and "left as they were" in str(members[1].error)
    assert members[2].outputs is not None  # within its deadline: written, no round trip asked
