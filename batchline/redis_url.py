"""What the URLs of Redis behind Sentinel and of a Redis Cluster share: a list of hosts where a
plain URL has one, and the plain URL's options (credentials, TLS files) read by redis-py's own
parser, so that every form means the same by them."""
from __future__ import annotations

import urllib.parse

from redis.asyncio.connection import parse_url

# Every blocking wait (BLMPOP, BLPOP) of a service lasts at most this long, and a blocking
# client's reads time out this long after a wait should have answered: a primary gone without
# closing its connections (a host lost) must not hold the waits on a dead socket.
BLOCKING_WAIT_S = 1


def blocking_read_timeout(timeout: float) -> float:
    return BLOCKING_WAIT_S + timeout + 2.0


def hosts(netloc_hosts: str, default_port: int, kind: str) -> list[tuple[str, int]]:
    """(host, port) of each item of `netloc_hosts` ("h:p,h,..."); ValueError naming the bad one.
    `kind` names the URL in messages ("Sentinel URL")."""
    found = []
    for item in netloc_hosts.split(","):
        host, _, port = item.strip().rpartition(":") if ":" in item else (item.strip(), "", "")
        if not host:
            raise ValueError(f"{kind} has an empty host in {netloc_hosts!r}")
        try:
            found.append((host, int(port) if port else default_port))
        except ValueError:
            raise ValueError(f"{kind} has a port that is not a number: {item!r}") from None
    return found


def options(scheme: str, userinfo: str, path: str, query: str) -> dict:
    """The connection options of a plain `scheme`:// URL with these parts, without host and port."""
    plain = urllib.parse.urlunsplit((scheme, f"{userinfo}@placeholder" if userinfo else "placeholder", path, query, ""))
    kwargs: dict = dict(parse_url(plain))
    for key in ("host", "port", "connection_class"):
        kwargs.pop(key, None)
    return kwargs
