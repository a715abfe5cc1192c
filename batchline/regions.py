"""System shared-memory regions as both ends of a request use them: the gateway, which registered
a client's region, and an executor on the same host, which reads the request's inputs from the
region and writes its outputs into it in place of the bytes travelling through Redis
(docs/design/shared-memory.md).

Regions are read and written through their file descriptor (pread/pwrite), never through a
mapping: a client may shrink its file at any time, and touching a mapped page past the end of
the file kills the process (SIGBUS), where a read returns short.
"""
from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass

from batchline.errors import InvalidArgument, Unavailable

SHM_ROOT = "/dev/shm"
# As glibc's shm_open opens: a key that is a symbolic link (to a file elsewhere on the host, which
# the client could not otherwise hand the gateway or an executor) is refused, not followed.
OPEN_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC
# An input's or output's parameter with the region reference the gateway queued in place of the
# bytes; internal: a client's request that carries it is refused.
REF = "batchline_region_ref"
# An answered output's parameter: the executor wrote this many bytes into the output's region.
WRITTEN = "batchline_region_written"


class RegionUnreadable(Unavailable):
    """A referenced region cannot be opened here (another host's, replaced, not permitted): the
    gateway holding the request queues it again with the bytes."""


@functools.lru_cache(maxsize=1)
def host_id() -> str:
    """Which /dev/shm this process sees: the kernel's boot id and the device of /dev/shm's mount
    (containers on one host share the boot id, but each has a /dev/shm of its own); "" when
    either is unknown, and then nobody is handed references."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
        return f"{boot}:{os.stat(SHM_ROOT).st_dev}" if boot else ""
    except OSError:
        return ""


def shm_path(key: str) -> str | None:
    """The file of a shm_open key like '/data': one path component under /dev/shm (nothing else
    on the host is reachable); None for a key that is not one."""
    name = key[1:] if key.startswith("/") else key
    if not name or "/" in name or "\0" in name or name in (".", ".."):
        return None
    return os.path.join(SHM_ROOT, name)


def too_small(output: str, room: int, size: int) -> InvalidArgument:
    return InvalidArgument(f"shared memory size specified with the request for output '{output}' ({room} bytes) "
                           f"should be at least {size} bytes to hold the results")


def shrank(what: str, region: str, key: str, end: int) -> InvalidArgument:
    return InvalidArgument(f"{what}: shared memory region '{region}' shrank below {end} bytes (key {key!r}): "
                           f"register it again")


def read_fd(fd: int, start: int, size: int, what: str, region: str, key: str) -> bytes:
    """`size` bytes at `start` of the file, or InvalidArgument when it holds fewer (now or by the
    time the read ends)."""
    if os.fstat(fd).st_size < start + size:
        raise shrank(what, region, key, start + size)
    data = os.pread(fd, size, start)  # into a buffer of its own: no zero-filled one to read into
    if len(data) == size:
        return data
    parts = [data]  # one read returns at most about 2 GiB: the rest, unless the file shrank
    got = len(data)
    while got < size:
        more = os.pread(fd, size - got, start + got)
        if not more:
            raise shrank(what, region, key, start + size)
        parts.append(more)
        got += len(more)
    return b"".join(parts)


def write_fd(fd: int, start: int, data: bytes, what: str, region: str, key: str) -> None:
    """Write `data` at `start`, within the file as it is (a write never grows a shrunk file)."""
    if os.fstat(fd).st_size < start + len(data):
        raise shrank(what, region, key, start + len(data))
    view, done = memoryview(data), 0
    while done < len(view):  # one write takes at most about 2 GiB
        done += os.pwrite(fd, view[done:], start + done)


@dataclass(frozen=True, slots=True)
class Ref:
    """Bytes [start, start + size) of the file of `key` (start: from the file's beginning), which
    is the inode `ino`: a file removed and created again under the key is another one."""
    region: str  # the client's name for it, for messages
    key: str
    ino: int
    start: int
    size: int

    def encode(self) -> str:
        return json.dumps([self.region, self.key, self.ino, self.start, self.size])

    @classmethod
    def decode(cls, text: str) -> Ref:
        region, key, ino, start, size = json.loads(text)
        return cls(region, key, ino, start, size)

    def _open(self, flags: int) -> int:
        path = shm_path(self.key)
        try:
            if path is None:
                raise OSError(0, f"{self.key!r} is not a shm_open key")
            fd = os.open(path, flags | OPEN_FLAGS)
        except OSError as exc:
            raise RegionUnreadable(f"shared memory region '{self.region}' (key {self.key!r}) cannot be opened "
                                   f"here ({exc.strerror})") from None
        if os.fstat(fd).st_ino != self.ino:
            os.close(fd)
            raise RegionUnreadable(f"shared memory region '{self.region}': key {self.key!r} is another file here")
        return fd

    def check(self, writable: bool = False) -> None:
        """RegionUnreadable unless the region opens here as the file the gateway registered."""
        os.close(self._open(os.O_RDWR if writable else os.O_RDONLY))

    def read(self, what: str) -> bytes:
        fd = self._open(os.O_RDONLY)
        try:
            return read_fd(fd, self.start, self.size, what, self.region, self.key)
        finally:
            os.close(fd)

    def write(self, what: str, data: bytes) -> None:
        fd = self._open(os.O_RDWR)
        try:
            write_fd(fd, self.start, data, what, self.region, self.key)
        finally:
            os.close(fd)
