"""Counts a process's Redis round trips and commands by the code that made them, for
benchmarks/round_trips.py (on PYTHONPATH only there; never in a service's own environment).

A round trip is one write to a Redis connection (a command alone, or a whole pipeline); its
commands are those packed into it. Each is charged to the innermost frame of the project's own
code outside the Redis contract's plumbing, e.g. "scheduler/service.py:_scan". SIGUSR2 writes the
counts so far to $BATCHLINE_REDIS_COUNT_DIR/<pid>.json.
"""
from __future__ import annotations

import json
import os
import signal
import sys
from collections import Counter

_DIR = os.environ.get("BATCHLINE_REDIS_COUNT_DIR")
_ROOT = os.environ.get("BATCHLINE_REDIS_COUNT_ROOT", "")
# Plumbing between a service's code and redis-py: charged to its caller instead.
_SKIP = ("batchline/contract/", "batchline/redis_client.py", "batchline/metrics.py")

if _DIR and _ROOT:
    import redis.asyncio.connection as _conn

    trips: Counter = Counter()
    commands: Counter = Counter()
    _pending = [0]  # commands packed since the last write

    def _site() -> str:
        f = sys._getframe(2)
        while f is not None:
            name = f.f_code.co_filename
            if name.startswith(_ROOT) and "/.venv/" not in name:
                rel = name[len(_ROOT) + 1:]
                if not rel.startswith(_SKIP):
                    return f"{rel}:{f.f_code.co_name}"
            f = f.f_back
        return "?"

    _pack = _conn.AbstractConnection.pack_command
    _send = _conn.AbstractConnection.send_packed_command

    def pack_command(self, *args):
        _pending[0] += 1
        return _pack(self, *args)

    async def send_packed_command(self, command, check_health=True):
        site = _site()
        trips[site] += 1
        commands[site] += _pending[0]
        _pending[0] = 0
        return await _send(self, command, check_health)

    _conn.AbstractConnection.pack_command = pack_command
    _conn.AbstractConnection.send_packed_command = send_packed_command

    # The contract's own connection for the hot calls (batchline.contract.link): a write there
    # is one round trip carrying `replies` commands (MULTI and EXEC among them, as in redis-py's).
    import batchline.contract.link as _link

    _link_send = _link.Link._send

    async def link_send(self, packed, replies, timeout):
        site = _site()
        trips[site] += 1
        commands[site] += replies or 1  # None: one command
        return await _link_send(self, packed, replies, timeout)

    _link.Link._send = link_send

    def _dump(signum, frame) -> None:
        path = os.path.join(_DIR, f"{os.getpid()}.json")
        with open(path + ".tmp", "w") as out:
            json.dump({"argv": sys.argv, "trips": trips, "commands": commands}, out)
        os.replace(path + ".tmp", path)

    signal.signal(signal.SIGUSR2, _dump)
