"""`batchline status`: the mesh on one screen, read from Redis (every service registers there).

The leader scheduler; each executor with its models, the execution provider each actually runs on,
its busy share and heartbeat age; each gateway; queue depth per model and priority level, for every
model served and every queue that holds requests, served or not (with every executor gone, the
queues are what is left to see). `--json` gives the same as one object, for scripts. Errors go to
stderr, with exit code 1.
"""
from __future__ import annotations

import json
import sys
import time

import redis
from redis.exceptions import RedisClusterException

from batchline import contract
from batchline.protocol import internal_pb2 as pb
from batchline.redis_client import connect_sync, mask


def gather(client: redis.Redis) -> dict:
    """What `batchline status` shows, as plain data."""
    now = time.time()
    leader = client.get(contract.LEADER)
    executors = []
    models: set[tuple[str, str]] = set()
    for eid in sorted(e.decode() for e in client.smembers(contract.EXECUTORS)):
        blob = client.get(contract.executor(eid))
        if blob is None:
            continue  # its heartbeat lapsed: the scheduler hands its batches back
        info = pb.ExecutorInfo.FromString(blob)
        executors.append({
            "id": eid, "address": info.address, "draining": info.draining,
            "heartbeat_age_s": round(max(0.0, now - info.heartbeat_us / 1e6), 3),
            "busy_share": round(info.busy_share, 3), "busy_batches": info.busy_batches,
            "executed_batches": info.executed_batches,
            "models": [{"name": m.name, "version": m.version, "provider": m.providers[0] if m.providers else "",
                        "unloading": m.unloading} for m in info.models],
        })
        models.update((m.name, m.version) for m in info.models)
    gateways = []
    for gid, expires_ms in client.zrange(contract.GATEWAYS, 0, -1, withscores=True):
        gid = gid.decode()
        address = client.get(contract.gateway(gid))
        if address is not None:
            gateways.append({"id": gid, "address": address.decode(),
                             "heartbeat_expires_in_s": round(max(0.0, expires_ms / 1000 - now), 3)})
    queues = [{"model": name, "version": version, **_depths(client, contract.queue(name, version)),
               "served": (name, version) in models}
              for name, version in sorted(models | _queued_models(client))]
    return {"leader": leader.decode() if leader else None, "executors": executors, "gateways": gateways,
            "queues": queues}


def _queued_models(client: redis.Redis) -> set[tuple[str, str]]:
    """The models whose queues hold requests, served or not (Redis drops an empty sorted set).
    A cluster client scans every primary."""
    prefix = contract.queue("*", "*").removesuffix(contract.model_tag("*", "*"))
    return {contract.parse_model_tag(key.decode()[len(prefix):])
            for key in client.scan_iter(match=contract.queue("*", "*"), count=1000)}


def _depths(client: redis.Redis, key: str) -> dict:
    depth = client.zcard(key)
    by_level = {}
    if depth:
        # The levels in use lie between the first entry's and the last's (the queue is priority-major).
        first, last = (client.zrange(key, i, i, withscores=True) for i in (0, -1))
        if first and last:  # else it emptied since the ZCARD
            levels = range(contract.priority_of(first[0][1]), contract.priority_of(last[0][1]) + 1)
            with client.pipeline(transaction=False) as pipe:
                for level in levels:
                    pipe.zcount(key, *contract.priority_scores(level))
                by_level = {str(level): n for level, n in zip(levels, pipe.execute()) if n}
    return {"depth": depth, "by_priority": by_level}


def render(status: dict) -> str:
    lines = [f"leader scheduler: {status['leader'] or '(none: nothing is dispatched)'}", "", "executors:"]
    if not status["executors"]:
        lines.append("  (none registered)")
    for e in status["executors"]:
        models = ", ".join(f"{m['name']}:{m['version']} on {m['provider'] or '?'}" + (" (unloading)" if m["unloading"] else "")
                           for m in e["models"])
        state = " draining" if e["draining"] else ""
        lines.append(f"  {e['id']}{state}: busy {e['busy_share']:.0%}, {e['busy_batches']} batches now, "
                     f"{e['executed_batches']} run, heartbeat {e['heartbeat_age_s']:.1f} s ago; {models}")
    lines += ["", "gateways:"]
    if not status["gateways"]:
        lines.append("  (none live)")
    for g in status["gateways"]:
        lines.append(f"  {g['id']} at {g['address']}")
    lines += ["", "queues (requests waiting, by priority level):"]
    if not status["queues"]:
        lines.append("  (no model served, no request waiting)")
    for q in status["queues"]:
        levels = ", ".join(f"priority {level}: {n}" for level, n in q["by_priority"].items())
        lines.append(f"  {q['model']}:{q['version']}: {q['depth']}" + (f" ({levels})" if levels else "")
                     + ("" if q["served"] else ", served by no executor"))
    return "\n".join(lines)


def main(redis_url: str, as_json: bool) -> int:
    try:
        client = connect_sync(redis_url, 5)  # a cluster's client connects here already
        try:
            status = gather(client)
        finally:
            client.close()
    except ValueError as exc:  # a malformed URL
        return _fail(f"batchline status: {exc}")
    except (redis.RedisError, RedisClusterException) as exc:
        return _fail(f"batchline status: cannot read the mesh's state from Redis at {mask(redis_url)}: {exc}")
    print(json.dumps(status, indent=2) if as_json else render(status), flush=True)
    return 0


def _fail(message: str) -> int:
    # One line: the Redis client's messages may span several.
    print(" ".join(message.split()), file=sys.stderr, flush=True)
    return 1
