"""Triton's system shared-memory extension: regions a client registers with this gateway, which
reads a request's inputs from them when it queues the request and writes the answer's outputs
into them when the answer arrives.

Regions belong to the gateway process that registered them (as to a Triton server): a client
registers with the gateway it sends its requests to. What the mesh queues is the tensors
themselves, so executors on other hosts serve these requests like any other.
"""
from __future__ import annotations

import mmap
import os
from dataclasses import dataclass

from batchline.codec import decode_tensor, encode_array
from batchline.errors import AlreadyExists, InvalidArgument
from batchline.protocol import inference_pb2 as ipb

REGION = "shared_memory_region"
BYTE_SIZE = "shared_memory_byte_size"
OFFSET = "shared_memory_offset"
SHM_ROOT = "/dev/shm"


@dataclass
class Region:
    name: str
    key: str
    offset: int
    byte_size: int
    memory: mmap.mmap
    fd: int  # kept open to see the file's size: touching a page past its end would kill the process

    def span(self, what: str, offset: int, size: int) -> slice:
        """The bytes [offset, offset + size) of the region (offsets within it, as clients give them)."""
        if offset + size > self.byte_size:
            raise InvalidArgument(
                f"{what}: invalid offset + byte size for shared memory region: '{self.name}' (offset {offset} + "
                f"{size} bytes is beyond its {self.byte_size} bytes)")
        start = self.offset + offset
        self.check(what, start + size)
        return slice(start, start + size)

    def check(self, what: str, end: int) -> None:
        """The region is still registered, and its file still holds `end` bytes (the client may have shrunk it)."""
        if self.memory.closed:
            raise InvalidArgument(f"{what}: shared memory region '{self.name}' was unregistered while the request ran")
        if os.fstat(self.fd).st_size < end:
            raise InvalidArgument(f"{what}: shared memory region '{self.name}' shrank below {end} bytes (key "
                                  f"{self.key!r}): register it again")

    def close(self) -> None:
        self.memory.close()
        os.close(self.fd)


def _int_param(params, name: str, what: str, default: int | None = None) -> int:
    if name not in params:
        if default is None:
            raise InvalidArgument(f"{what}: '{REGION}' is set but '{name}' is not")
        return default
    param = params[name]
    kind = param.WhichOneof("parameter_choice")
    if kind not in ("int64_param", "uint64_param") or getattr(param, kind) < 0:
        raise InvalidArgument(f"{what}: parameter '{name}' must be an integer >= 0")
    return getattr(param, kind)


# raw_input_contents is field 7 of ModelInferRequest, length-delimited (wire type 2).
_RAW_INPUT_TAG = bytes([(7 << 3) | 2])


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _strip(params) -> None:
    for name in (REGION, BYTE_SIZE, OFFSET):
        if name in params:
            del params[name]


class SharedMemory:
    """The regions registered with this gateway, by tenant and name: with tokens, a tenant sees, uses
    and unregisters only the regions it registered ('' is the tenant of an unauthenticated gateway)."""

    def __init__(self) -> None:
        self.regions: dict[tuple[str, str], Region] = {}

    def register(self, name: str, key: str, offset: int, byte_size: int, tenant: str = "") -> None:
        if not name:
            raise InvalidArgument("a shared memory region needs a name")
        if (tenant, name) in self.regions:
            raise AlreadyExists(f"shared memory region '{name}' already in manager: unregister it first")
        # One path component under /dev/shm, as shm_open takes it: nothing else on the host is reachable.
        path_name = key[1:] if key.startswith("/") else key
        if not path_name or "/" in path_name or path_name in (".", ".."):
            raise InvalidArgument(f"shared memory region '{name}': key {key!r} is not a shm_open name like '/data'")
        try:
            fd = os.open(os.path.join(SHM_ROOT, path_name), os.O_RDWR)
        except OSError as exc:
            raise InvalidArgument(f"shared memory region '{name}': unable to open shared memory key {key!r} "
                                  f"({exc.strerror}): create it on this gateway's host before registering") from None
        try:
            size = os.fstat(fd).st_size
            if byte_size == 0 or offset + byte_size > size:
                raise InvalidArgument(f"shared memory region '{name}': "
                                      f"offset {offset} + byte size {byte_size} does not "
                                      f"fit key {key!r}, which holds {size} bytes")
            memory = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self.regions[(tenant, name)] = Region(name, key, offset, byte_size, memory, fd)

    def _names(self, tenant: str) -> list[str]:
        return sorted(n for t, n in self.regions if t == tenant)

    def unregister(self, name: str, tenant: str = "") -> None:
        """Unregister the tenant's `name` ('' = every region of the tenant); a name not registered is
        no error (as in Triton)."""
        for region_name in ([name] if name else self._names(tenant)):
            region = self.regions.pop((tenant, region_name), None)
            if region is not None:
                region.close()

    def close(self) -> None:
        """Every tenant's regions unmapped: the gateway stops."""
        for region in self.regions.values():
            region.close()
        self.regions.clear()

    def status(self, name: str, tenant: str = "") -> list[Region]:
        if not name:
            return [self.regions[(tenant, n)] for n in self._names(tenant)]
        if (tenant, name) not in self.regions:
            raise InvalidArgument(f"shared memory region '{name}' is not registered with this gateway")
        return [self.regions[(tenant, name)]]

    def _region(self, what: str, params, tenant: str) -> tuple[Region, slice]:
        region_name = params[REGION].string_param
        region = self.regions.get((tenant, region_name))
        if region is None:
            raise InvalidArgument(
                f"{what}: unable to find shared memory region: '{region_name}' (regions are per gateway: register it "
                f"with SystemSharedMemoryRegister on the gateway you send to; this one has "
                f"{self._names(tenant) or 'none'})")
        return region, region.span(what, _int_param(params, OFFSET, what, 0), _int_param(params, BYTE_SIZE, what))

    def read_inputs(self, request: ipb.ModelInferRequest, tenant: str = "") -> tuple[ipb.ModelInferRequest, bytes]:
        """The request with the inputs it has in regions read into its raw_input_contents (every input
        raw then), and it serialized; the request itself and b"" when it names no region."""
        if not any(REGION in t.parameters for t in request.inputs):
            return request, b""
        sent = list(request.raw_input_contents)
        in_message = [t for t in request.inputs if REGION not in t.parameters]
        if sent and len(sent) != len(in_message):
            raise InvalidArgument(f"raw_input_contents has {len(sent)} entries for the {len(in_message)} inputs "
                                  f"not in shared memory; send each of those raw, or none")
        raw: list = []
        for tensor in request.inputs:
            if REGION in tensor.parameters:
                region, span = self._region(f"input '{tensor.name}'", tensor.parameters, tenant)
                raw.append(memoryview(region.memory)[span])
                _strip(tensor.parameters)
            elif sent:
                raw.append(sent.pop(0))
            else:  # typed contents: the same bytes raw would carry
                array = decode_tensor(tensor.name, tensor.datatype, list(tensor.shape), None, tensor.contents)
                raw.append(encode_array(array)[2])
                tensor.ClearField("contents")
        del request.raw_input_contents[:]
        # The raw contents spliced in as their wire encoding, which is also what is queued, and the
        # whole parsed once: appending a megabyte to a repeated bytes field costs milliseconds,
        # the splice a copy and the parse next to nothing.
        parts = [request.SerializeToString()]
        for data in raw:
            parts += [_RAW_INPUT_TAG, _varint(len(data)), data]
        try:
            payload = b"".join(parts)
            return ipb.ModelInferRequest.FromString(payload), payload
        finally:
            for data in raw:
                if isinstance(data, memoryview):
                    data.release()  # a region may be unregistered (its map closed) once this returns

    def output_targets(self, request: ipb.ModelInferRequest, tenant: str = "") -> dict[str, tuple[Region, slice]]:
        """The outputs a request wants written into regions, checked (and their parameters taken off)."""
        targets = {}
        for out in request.outputs:
            if REGION in out.parameters:
                targets[out.name] = self._region(f"output '{out.name}'", out.parameters, tenant)
                _strip(out.parameters)
        return targets

    @staticmethod
    def write_outputs(response: ipb.ModelInferResponse, targets: dict[str, tuple[Region, slice]]) -> None:
        """Write the outputs named in `targets` into their regions; their raw contents leave the answer."""
        raw = response.raw_output_contents
        for i, out in enumerate(response.outputs):
            if out.name not in targets or i >= len(raw):
                continue
            region, span = targets[out.name]
            data = raw[i]
            room = span.stop - span.start
            if len(data) > room:
                raise InvalidArgument(
                    f"shared memory size specified with the request for output '{out.name}' ({room} bytes) should be "
                    f"at least {len(data)} bytes to hold the results")
            region.check(f"output '{out.name}'", span.start + len(data))
            region.memory[span.start:span.start + len(data)] = data
            out.parameters[REGION].string_param = region.name
            out.parameters[BYTE_SIZE].int64_param = len(data)
            if span.start != region.offset:
                out.parameters[OFFSET].int64_param = span.start - region.offset
            raw[i] = b""
        if all(not r for r in raw):
            del raw[:]
