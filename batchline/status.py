"""`batchline status`: the mesh on one screen, read from Redis (every service registers there).

The leader scheduler; each executor with its models, the execution provider each actually runs on,
its busy share and heartbeat age; each gateway; queue depth per model and priority level, for every
model served and every queue that holds requests, served or not (with every executor gone, the
queues are what is left to see); the executors the leader wants, and per model the arrival rate,
its forecast and one executor's capacity behind that (scheduler/demand.py). `--json` gives the same as one object, for
scripts. Errors go to
stderr, with exit code 1.
"""
from __future__ import annotations

import json
import sys
import time

import redis
from redis.exceptions import RedisClusterException

from batchline.contract.admin_store import AdminStore
from batchline.contract.keys import ModelKey
from batchline.protocol import internal_pb2 as pb
from batchline.redis_client import connect_sync, mask


def gather(store: AdminStore) -> dict:
    """What `batchline status` shows, as plain data."""
    now = time.time()
    executors = []
    models: set[ModelKey] = set()
    for eid in store.executor_ids():
        blob = store.registration(eid)
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
    for gid, expires_ms in store.gateways():
        address = store.gateway_address(gid)
        if address is not None:
            gateways.append({"id": gid, "address": address,
                             "heartbeat_expires_in_s": round(max(0.0, expires_ms / 1000 - now), 3)})
    queues = []
    for name, version in sorted(models | store.queued_models()):
        depth, by_level = store.depths((name, version))
        queues.append({"model": name, "version": version, "depth": depth,
                       "by_priority": {str(level): n for level, n in by_level.items()},
                       "served": (name, version) in models})
    return {"leader": store.leader(), "executors": executors, "gateways": gateways, "queues": queues,
            "demand": demand(store.demand())}


def demand(blob: bytes | None) -> dict | None:
    """The leader's MeshDemand as plain data; None when none is live."""
    if blob is None:
        return None
    d = pb.MeshDemand.FromString(blob)
    return {"executors_wanted": d.executors_wanted, "horizon_s": round(d.horizon_s, 3),
            "executor_start_s": round(d.executor_start_s, 3),
            "models": [{"model": m.name, "version": m.version, "arrival_rate": round(m.arrival_rate, 3),
                        "forecast_rate": round(m.forecast_rate, 3), "queued_rate": round(m.queued_rate, 3),
                        "capacity": round(m.capacity, 3),
                        "budget_s": m.budget_s, "backlog": m.backlog,
                        "executors": round(max(m.by_forecast, m.by_backlog), 3)} for m in d.models]}


def render(status: dict) -> str:
    lines = [f"leader scheduler: {status['leader'] or '(none: nothing is dispatched)'}", "", "executors:"]
    if not status["executors"]:
        lines.append("  (none registered)")
    for e in status["executors"]:
        models = ", ".join(f"{m['name']}:{m['version']} on {m['provider'] or '?'}"
                           + (" (unloading)" if m["unloading"] else "")
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
    d = status.get("demand")
    lines += ["", "demand (leader's forecast):"]
    if d is None:
        lines.append("  (none published: no leader scheduler)")
    else:
        start = f"{d['executor_start_s']:.1f} s" if d["executor_start_s"] else "not measured yet"
        lines.append(f"  executors wanted: {d['executors_wanted']} (forecast {d['horizon_s']:.1f} s ahead; "
                     f"an executor starts in {start})")
        for m in d["models"]:
            surge = (f", {m['queued_rate']:.1f}/s by its queue" if m.get("queued_rate", 0) > m["forecast_rate"]
                     else "")
            lines.append(f"  {m['model']}:{m['version']}: {m['arrival_rate']:.1f}/s now, {m['forecast_rate']:.1f}/s "
                         f"forecast{surge}, {m['capacity']:.1f}/s per executor within {m['budget_s'] * 1000:.0f} ms, "
                         f"{m['backlog']} queued: {m['executors']:.2f} executors")
    return "\n".join(lines)


def main(redis_url: str, as_json: bool) -> int:
    try:
        store = AdminStore(connect_sync(redis_url, 5))  # a cluster's client connects here already
        try:
            status = gather(store)
        finally:
            store.close()
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
