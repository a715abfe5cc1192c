"""Which executors are alive and which model versions they serve.

Executors publish an ExecutorInfo under a key that expires unless their
heartbeat refreshes it; readers (gateway, scheduler) rebuild this view from
Redis, so nothing about the fleet is held anywhere but Redis.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import redis.asyncio as aioredis

from batchline import contract
from batchline.errors import NotFound
from batchline.protocol import internal_pb2 as pb


def _version_key(version: str) -> tuple[int, str]:
    return (int(version), "") if version.isdigit() else (-1, version)


@dataclass
class Registry:
    executors: dict[str, pb.ExecutorInfo] = field(default_factory=dict)
    models: dict[tuple[str, str], pb.ModelInfo] = field(default_factory=dict)
    holders: dict[tuple[str, str], list[str]] = field(default_factory=dict)
    # Registered but without a live heartbeat: dead, or stopped. The
    # scheduler hands their batches back and then forgets them.
    stale: list[str] = field(default_factory=list)

    @classmethod
    async def load(cls, redis: aioredis.Redis) -> "Registry":
        ids = sorted(m.decode() for m in await redis.smembers(contract.EXECUTORS))
        reg = cls()
        if not ids:
            return reg
        blobs = await redis.mget([contract.executor(i) for i in ids])
        for eid, blob in zip(ids, blobs):
            if blob is None:
                reg.stale.append(eid)
                continue
            reg.add(pb.ExecutorInfo.FromString(blob))
        return reg

    def add(self, info: pb.ExecutorInfo) -> None:
        self.executors[info.executor_id] = info
        for m in info.models:
            key = (m.name, m.version)
            self.models.setdefault(key, m)
            self.holders.setdefault(key, []).append(info.executor_id)

    def versions(self, name: str) -> list[str]:
        return sorted({v for (n, v) in self.models if n == name}, key=_version_key)

    def model_names(self) -> list[str]:
        return sorted({n for (n, _) in self.models})

    def resolve(self, name: str, version: str = "") -> pb.ModelInfo:
        """The served ModelInfo for name/version ('' = the latest version)."""
        versions = self.versions(name)
        if not versions:
            served = ", ".join(self.model_names()) or "none"
            raise NotFound(f"model '{name}' is not served by any live executor (served models: {served})")
        if not version:
            version = versions[-1]
        info = self.models.get((name, version))
        if info is None:
            raise NotFound(f"model '{name}' has no version '{version}' (available: {', '.join(versions)})")
        return info
