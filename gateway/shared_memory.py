"""Triton's system shared-memory extension: regions a client registers with this gateway, which
reads a request's inputs from them when it queues the request and writes the answer's outputs
into them when the answer arrives.

Regions belong to the gateway process that registered them (as to a Triton server): a client
registers with the gateway it sends its requests to. When every executor serving the model
shares this gateway's /dev/shm (batchline/regions.py), what the mesh queues is a reference to the
region instead of its bytes, and the executor reads the inputs and writes the outputs itself;
otherwise the tensors themselves, so that executors on other hosts serve these requests like any
other (docs/design/shared-memory.md).
"""
from __future__ import annotations

import errno
import logging
import os
import resource
from dataclasses import dataclass
from typing import Callable

from batchline.codec import decode_tensor, encode_array
from batchline.errors import AlreadyExists, InvalidArgument, ResourceExhausted
from batchline.protocol import inference_pb2 as ipb
from batchline.regions import OPEN_FLAGS, REF, WRITTEN, Ref, read_fd, shm_path, shrank, too_small, write_fd

log = logging.getLogger(__name__)

REGION = "shared_memory_region"
BYTE_SIZE = "shared_memory_byte_size"
OFFSET = "shared_memory_offset"
# Regions one tenant may hold registered: each keeps a file open on the gateway, whose open files
# every client's connections share.
MAX_REGIONS = 1024


def open_files_for_regions() -> int:
    """How many region files the gateway may hold open, all tenants together: half its limit of
    open files, raised first to the hard limit (the default soft limit, often 1,024, is one
    tenant's regions), so that the other half stays for connections and everything else."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        want = 1 << 20 if hard == resource.RLIM_INFINITY else hard
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    return max(1, soft // 2)

# The request as queued with its inputs' bytes copied in (request, payload): what the gateway
# queues again when an executor could not read the regions a request references.
Copied = Callable[[], tuple[ipb.ModelInferRequest, bytes]]


@dataclass
class Region:
    name: str
    key: str
    offset: int
    byte_size: int
    fd: int  # read and written with pread/pwrite: a client may shrink its file at any time
    ino: int
    closed: bool = False

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
        if self.closed:
            raise InvalidArgument(f"{what}: shared memory region '{self.name}' was unregistered while the request ran")
        if os.fstat(self.fd).st_size < end:
            raise shrank(what, self.name, self.key, end)

    def read(self, what: str, span: slice) -> bytes:
        self.check(what, span.stop)
        return read_fd(self.fd, span.start, span.stop - span.start, what, self.name, self.key)

    def write(self, what: str, start: int, data: bytes) -> None:
        self.check(what, start + len(data))
        write_fd(self.fd, start, data, what, self.name, self.key)

    def ref(self, span: slice) -> str:
        return Ref(self.name, self.key, self.ino, span.start, span.stop - span.start).encode()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
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


def _spliced(request: ipb.ModelInferRequest, raw: list) -> tuple[ipb.ModelInferRequest, bytes]:
    """The request (no raw contents of its own) with `raw` as its raw_input_contents, parsed, and
    serialized. The raw contents are spliced in as their wire encoding, which is also what is
    queued, and the whole parsed once: appending a megabyte to a repeated bytes field costs
    milliseconds, the splice a copy and the parse next to nothing."""
    parts = [request.SerializeToString()]
    for data in raw:
        parts += [_RAW_INPUT_TAG, _varint(len(data)), data]
    payload = b"".join(parts)
    return ipb.ModelInferRequest.FromString(payload), payload


def _copied(request: bytes, sources: list) -> tuple[ipb.ModelInferRequest, bytes]:
    """`request` (serialized, without raw contents) with its inputs' bytes: each source is the
    bytes, or (region, span, what) to read them from."""
    return _spliced(ipb.ModelInferRequest.FromString(request),
                    [s if isinstance(s, (bytes, bytearray)) else s[0].read(s[2], s[1]) for s in sources])


def _internal(what: str) -> InvalidArgument:
    return InvalidArgument(f"{what}: parameter '{REF}' is batchline's own; a request may not set it")


# The extended attribute that marks a region's file as a tenant's: on the file itself, so that every
# gateway of the host sees it (each keeps its own registrations), it stays after an unregistration
# (the file is still the tenant's memory) and goes with the file.
OWNER_XATTR = "user.batchline.tenant"
_unmarked_warned = False


def _unsupported(exc: OSError) -> bool:
    """Whether `exc` says the filesystem takes no user extended attributes (said in the log once)."""
    global _unmarked_warned
    if exc.errno not in (errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    if not _unmarked_warned:
        _unmarked_warned = True
        log.warning("shared-memory files cannot be marked with their tenant here (%s): a tenant's region is kept "
                    "from others only within each gateway; serve one gateway a host for tenancy across them",
                    exc.strerror)
    return True


def _owned(fd: int, tenant: str, claim: bool = False) -> bool:
    """Whether the file open at `fd` is `tenant`'s to register: unmarked, or marked as its; with
    `claim`, an unmarked file is marked as its (exclusively: of two tenants racing, one wins).
    Without tokens ('' tenant) nothing is marked or checked. Where the filesystem takes no user
    extended attributes (tmpfs before Linux 6.6) each gateway checks only its own registrations."""
    if not tenant:
        return True
    mine = tenant.encode()
    if claim:
        try:
            os.setxattr(fd, OWNER_XATTR, mine, os.XATTR_CREATE)
            return True
        except FileExistsError:
            pass  # marked already: by whom, read below
        except OSError as exc:
            if _unsupported(exc):
                return True
            log.warning("a shared-memory file of tenant %r could not be marked as its (%s)", tenant, exc.strerror)
    try:
        return os.getxattr(fd, OWNER_XATTR) == mine
    except OSError as exc:
        return exc.errno == errno.ENODATA or _unsupported(exc)  # unmarked, or no marks here


class SharedMemory:
    """The regions registered with this gateway, by tenant and name: with tokens, a tenant sees, uses
    and unregisters only the regions it registered ('' is the tenant of an unauthenticated gateway)."""

    def __init__(self, max_copy_bytes: int = 0, max_open: int | None = None) -> None:
        self.regions: dict[tuple[str, str], Region] = {}
        # Region files open at once, every tenant's: past it one tenant's registrations could take
        # the file descriptors every connection needs.
        self.max_open = open_files_for_regions() if max_open is None else max_open
        # The most bytes a request's inputs may come to once copied from regions into its payload (0:
        # no cap): the gateway's max_message_bytes, as if they had come in the message.
        self.max_copy_bytes = max_copy_bytes

    def register(self, name: str, key: str, offset: int, byte_size: int, tenant: str = "") -> None:
        if not name:
            raise InvalidArgument("a shared memory region needs a name")
        if (tenant, name) in self.regions:
            raise AlreadyExists(f"shared memory region '{name}' already in manager: unregister it first")
        if len(self._names(tenant)) >= MAX_REGIONS:
            raise ResourceExhausted(f"shared memory region '{name}': {MAX_REGIONS} regions are registered already "
                                    "(each holds a file open on the gateway): unregister some first")
        if len(self.regions) >= self.max_open:
            raise ResourceExhausted(f"shared memory region '{name}': this gateway holds as many region files open "
                                    f"as it may ({self.max_open}): retry later, or on another gateway")
        path = shm_path(key)
        if path is None:
            raise InvalidArgument(f"shared memory region '{name}': key {key!r} is not a shm_open name like '/data'")
        try:
            fd = os.open(path, os.O_RDWR | OPEN_FLAGS)
        except OSError as exc:
            raise InvalidArgument(f"shared memory region '{name}': unable to open shared memory key {key!r} "
                                  f"({exc.strerror}): create it on this gateway's host before registering") from None
        try:
            stat = os.fstat(fd)
            # Another tenant's memory: read as an input or written as an output, it would cross
            # tenants. Worded as the open of a file the gateway may not open, so as to say nothing
            # of the other; checked before anything else about the file is said.
            refused = InvalidArgument(f"shared memory region '{name}': unable to open shared memory key {key!r} "
                                      f"({os.strerror(errno.EACCES)}): create a key of your own on this gateway's "
                                      "host before registering")
            if any(r.ino == stat.st_ino and t != tenant for (t, _), r in self.regions.items()) or \
                    not _owned(fd, tenant):
                raise refused
            if byte_size == 0 or offset + byte_size > stat.st_size:
                raise InvalidArgument(f"shared memory region '{name}': "
                                      f"offset {offset} + byte size {byte_size} does not "
                                      f"fit key {key!r}, which holds {stat.st_size} bytes")
            # Marked last: a registration refused for its sizes claims nothing.
            if not _owned(fd, tenant, claim=True):
                raise refused
        except BaseException:
            os.close(fd)
            raise
        self.regions[(tenant, name)] = Region(name, key, offset, byte_size, fd, stat.st_ino)

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
        """Every tenant's regions closed: the gateway stops."""
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

    def output_targets(self, request: ipb.ModelInferRequest, tenant: str = "") -> dict[str, tuple[Region, slice]]:
        """The outputs a request wants written into regions, checked (and their parameters taken off)."""
        targets = {}
        for out in request.outputs:
            if REF in out.parameters:
                raise _internal(f"output '{out.name}'")
            if REGION in out.parameters:
                targets[out.name] = self._region(f"output '{out.name}'", out.parameters, tenant)
                _strip(out.parameters)
        return targets

    @staticmethod
    def in_regions(request: ipb.ModelInferRequest) -> bool:
        """Whether the request names a region for an input (or sets batchline's own parameter)."""
        return any(REGION in t.parameters or REF in t.parameters for t in request.inputs)

    def read_inputs(self, request: ipb.ModelInferRequest, tenant: str = "",
                    targets: dict[str, tuple[Region, slice]] | None = None,
                    by_reference: bool = False,
                    regions: bool | None = None) -> tuple[ipb.ModelInferRequest, bytes, Copied | None]:
        """The request as queued, and it serialized (b"": the request itself, as it came): the inputs
        it has in regions read into its raw_input_contents (every input raw then); or, `by_reference`,
        its fixed-size inputs and its `targets` referenced (batchline/regions.py), with how to make
        the copied form should an executor not read the regions after all. `regions`: what
        `in_regions` says of the request, where the caller has asked already."""
        if regions is None:
            regions = self.in_regions(request)
        by_reference = by_reference and (bool(targets) or regions)
        if not by_reference and not regions:
            return request, b"", None
        sent = list(request.raw_input_contents)
        in_message = [t for t in request.inputs if REGION not in t.parameters]
        if sent and len(sent) != len(in_message):
            raise InvalidArgument(f"raw_input_contents has {len(sent)} entries for the {len(in_message)} inputs "
                                  f"not in shared memory; send each of those raw, or none")
        sources: list = []
        for tensor in request.inputs:
            if REF in tensor.parameters:
                raise _internal(f"input '{tensor.name}'")
            if REGION in tensor.parameters:
                what = f"input '{tensor.name}'"
                region, span = self._region(what, tensor.parameters, tenant)
                sources.append((region, span, what))
                _strip(tensor.parameters)
            elif sent:
                sources.append(sent.pop(0))
            else:  # typed contents: the same bytes raw would carry
                array = decode_tensor(tensor.name, tensor.datatype, list(tensor.shape), None, tensor.contents)
                sources.append(encode_array(array)[2])
                tensor.ClearField("contents")
        del request.raw_input_contents[:]
        template = request.SerializeToString()
        if not by_reference:
            self._check_copy(template, sources)
            return (*_copied(template, sources), None)
        raw: list = []
        for tensor, source in zip(request.inputs, sources):
            if isinstance(source, tuple) and tensor.datatype != "BYTES":
                region, span, what = source
                tensor.parameters[REF].string_param = region.ref(span)  # its size checked by validation
                raw.append(b"")
            else:  # BYTES are read to be checked here, and are small: copied
                raw.append(source if not isinstance(source, tuple) else source[0].read(source[2], source[1]))
        for out in request.outputs:
            if out.name in (targets or {}):
                region, span = targets[out.name]  # type: ignore[index]
                out.parameters[REF].string_param = region.ref(span)
        def copied() -> tuple[ipb.ModelInferRequest, bytes]:
            self._check_copy(template, sources)
            return _copied(template, sources)

        return (*_spliced(request, raw), copied)

    def _check_copy(self, template: bytes, sources: list) -> None:
        """ResourceExhausted when the inputs, copied from their regions into the payload, would come to
        more than max_copy_bytes: one payload past what the gateway takes in a message, and a write too
        big for Redis would fail the whole group commit it went in, its neighbours with it."""
        size = len(template) + sum(len(x) if not isinstance(x, tuple) else x[1].stop - x[1].start for x in sources)
        if self.max_copy_bytes and size > self.max_copy_bytes:
            raise ResourceExhausted(f"the request comes to {size} bytes with its inputs copied from shared memory, "
                                    f"over the gateway's max_message_bytes of {self.max_copy_bytes}: a request whose "
                                    "inputs are copied to the executors takes no more than one in a message")

    @staticmethod
    def write_outputs(response: ipb.ModelInferResponse, targets: dict[str, tuple[Region, slice]]) -> None:
        """Write the outputs named in `targets` into their regions (unless the executor wrote them);
        their raw contents leave the answer."""
        raw = response.raw_output_contents
        for i, out in enumerate(response.outputs):
            if out.name not in targets or i >= len(raw):
                continue
            region, span = targets[out.name]
            if WRITTEN in out.parameters:
                size = out.parameters[WRITTEN].int64_param
                del out.parameters[WRITTEN]
            else:
                data = raw[i]
                size = len(data)
                if size > span.stop - span.start:
                    raise too_small(out.name, span.stop - span.start, size)
                region.write(f"output '{out.name}'", span.start, data)
            out.parameters[REGION].string_param = region.name
            out.parameters[BYTE_SIZE].int64_param = size
            if span.start != region.offset:
                out.parameters[OFFSET].int64_param = span.start - region.offset
            raw[i] = b""
        if all(not r for r in raw):
            del raw[:]
