"""Whether a TCP port is taken, and by whom.

gRPC's servers set SO_REUSEPORT unless told not to, so a second server on a port that one already
serves starts without error and the kernel splits the connections between the two. Only the
gateways of one mesh may share their port: a gateway binds without SO_REUSEPORT unless it is told
to share, and before it binds it looks whether the port is already taken, and by what.
"""
from __future__ import annotations

import errno
import os
import re
import socket

# Socket state LISTEN in /proc/net/tcp.
_LISTEN = "0A"
_CREDENTIALS = re.compile(r"(://)[^@/\s]*@")
_SECRET_FLAG = re.compile(r"^-.*(password|token|secret)", re.IGNORECASE)


class PortInUse(OSError):
    """The port is served by a process that may not share it; the message names that process."""

    def __init__(self, port: int, hint: str = ""):
        super().__init__(f"port {port} is in use by {owner(port)}{': ' + hint if hint else ''}")


def free_port(host: str) -> int:
    """A port nothing listens on now (the kernel's pick)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, kind, proto) as probe:
        probe.bind(address)
        return probe.getsockname()[1]


def in_use(host: str, port: int) -> bool:
    """Whether a socket listens on host:port (or on every interface, which covers it)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, kind, proto) as probe:
        # As a server's own bind: a connection lingering in TIME_WAIT does not take the port.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return True
            raise
    return False


def _listening_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    fields = line.split()
                    if fields[3] == _LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add(fields[9])
        except OSError:
            continue
    return inodes


def redacted(argv: list[str]) -> str:
    """A command line fit for a message: a URL's credentials and the value after a flag that names
    a password, token or secret are ***. (A service's command line carries its Redis URL.)"""
    words, hide = [], False
    for arg in filter(None, argv):
        words.append("***" if hide else _CREDENTIALS.sub(r"\1***@", arg))
        hide = "=" not in arg and _SECRET_FLAG.search(arg) is not None
    return " ".join(words)


def owner(port: int) -> str:
    """Who listens on `port`: "pid N (command line)" where this user may see it (Linux's /proc)."""
    inodes = {f"socket:[{inode}]" for inode in _listening_inodes(port)}
    if inodes:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                fds = os.listdir(f"/proc/{pid}/fd")
                if any(_link(f"/proc/{pid}/fd/{fd}") in inodes for fd in fds):
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        argv = f.read().decode(errors="replace").split("\0")
                    return f"pid {pid} ({redacted(argv)[:120]})"
            except OSError:
                continue  # gone, or another user's
    return "another process"


def _link(path: str) -> str:
    """What an fd points at ("": closed meanwhile: a busy process opens and closes them as it is read)."""
    try:
        return os.readlink(path)
    except OSError:
        return ""
