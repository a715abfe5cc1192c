"""`batchline status`: the mesh on one screen, read from Redis (every service registers there).

The leader scheduler; each executor with its models, the execution provider each actually runs on,
its busy share and heartbeat age; each gateway; queue depth per model and priority level. `--json`
gives the same as one object, for scripts.
"""
from __future__ import annotations

import json
import time

import redis

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
    queues = []
    for name, version in sorted(models):
        key = contract.queue(name, version)
        depth = client.zcard(key)
        by_level = {}
        if depth:
            # The levels in use lie between the first entry's and the last's (the queue is priority-major).
            first, last = (client.zrange(key, i, i, withscores=True) for i in (0, -1))
            levels = range(contract.priority_of(first[0][1]), contract.priority_of(last[0][1]) + 1)
            with client.pipeline(transaction=False) as pipe:
                for level in levels:
                    pipe.zcount(key, *contract.priority_scores(level))
                by_level = {str(level): n for level, n in zip(levels, pipe.execute()) if n}
        queues.append({"model": name, "version": version, "depth": depth, "by_priority": by_level})
    return {"leader": leader.decode() if leader else None, "executors": executors, "gateways": gateways,
            "queues": queues}


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
        lines.append("  (no model served)")
    for q in status["queues"]:
        levels = ", ".join(f"priority {level}: {n}" for level, n in q["by_priority"].items())
        lines.append(f"  {q['model']}:{q['version']}: {q['depth']}" + (f" ({levels})" if levels else ""))
    return "\n".join(lines)


def main(redis_url: str, as_json: bool) -> int:
    client = connect_sync(redis_url, 5)
    try:
        status = gather(client)
    except redis.RedisError as exc:
        print(f"batchline status: cannot read the mesh's state from Redis at {mask(redis_url)}: {exc}", flush=True)
        return 1
    finally:
        client.close()
    print(json.dumps(status, indent=2) if as_json else render(status), flush=True)
    return 0
