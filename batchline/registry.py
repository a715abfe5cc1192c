"""Which executors are alive and which model versions they serve.

Executors publish an ExecutorInfo under a key that expires unless their
heartbeat refreshes it; readers (gateway, scheduler) rebuild this view from
Redis, so nothing about the fleet is held anywhere but Redis.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from batchline.contract.keys import ModelKey
from batchline.contract.store import Store
from batchline.errors import InvalidArgument, NotFound
from batchline.protocol import internal_pb2 as pb


def model_name_problem(name: str) -> str | None:
    """Why `name` cannot name a model of the repository (None: it can). A model is a directory
    of the repository, and a name the executors join to its path: one that walks out of it
    (`..`, a separator) would read, write or delete files elsewhere, another tenant's model's too."""
    if not name:
        return "it is empty"
    if name in (".", "..") or any(c in name for c in "/\\:\0"):
        return "a model's name is one directory of the repository: no '/', '\\', ':' or NUL, not '.' or '..'"
    if len(name.encode()) > 255:
        return "it is longer than a directory name may be (255 bytes)"
    return None


def _version_key(version: str) -> tuple[int, str]:
    return (int(version), "") if version.isdigit() else (-1, version)


@dataclass
class Registry:
    executors: dict[str, pb.ExecutorInfo] = field(default_factory=dict)
    # Every version some executor advertises, serving or being released (its queue is still served).
    models: dict[ModelKey, pb.ModelInfo] = field(default_factory=dict)
    holders: dict[ModelKey, list[str]] = field(default_factory=dict)  # executors serving it
    leaving: dict[ModelKey, list[str]] = field(default_factory=dict)  # executors releasing it
    # Registered but without a live heartbeat: dead, or stopped. The
    # scheduler hands their batches back and then forgets them.
    stale: list[str] = field(default_factory=list)
    # versions() per name: the gateway resolves every request (twice when it is refused), and a
    # registry changes only when it is loaded.
    _versions: dict[str, list[str]] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    async def load(cls, store: Store) -> "Registry":
        """The registry as `store` reads it (any role's store)."""
        reg = cls()
        for eid, blob in await store.registrations():
            if blob is None:
                reg.stale.append(eid)
                continue
            reg.add(pb.ExecutorInfo.FromString(blob))
        return reg

    def add(self, info: pb.ExecutorInfo) -> None:
        self._versions.clear()
        self.executors[info.executor_id] = info
        for m in info.models:
            key = (m.name, m.version)
            if key not in self.models or (self.models[key].unloading and not m.unloading):
                self.models[key] = m
            (self.leaving if m.unloading else self.holders).setdefault(key, []).append(info.executor_id)

    def versions(self, name: str) -> list[str]:
        """The versions of `name` that take requests (some executor serves them, not just releases them)."""
        found = self._versions.get(name)
        if found is None:
            found = self._versions[name] = sorted({v for (n, v) in self.holders if n == name}, key=_version_key)
        return list(found)

    def model_names(self) -> list[str]:
        return sorted({n for (n, _) in self.holders})

    def releasing(self, name: str) -> bool:
        """Every advertised version of `name` is being released: it is unloading."""
        return any(n == name for n, _ in self.leaving) and not self.versions(name)

    def repository(self) -> list[pb.RepositoryEntry]:
        """The model repository as the executors see it: per model and version, the best state any
        executor has it in (READY, LOADING, UNLOADING, UNAVAILABLE with a reason, never loaded)."""
        rank = {"READY": 0, "LOADING": 1, "UNLOADING": 2, "UNAVAILABLE": 3, "": 4}
        best: dict[ModelKey, pb.RepositoryEntry] = {}
        for info in self.executors.values():
            for e in info.repository:
                seen = best.get((e.name, e.version))
                if seen is None or rank.get(e.state, 5) < rank.get(seen.state, 5):
                    best[(e.name, e.version)] = e
        versioned = {n for n, v in best if v}
        # A model that some executor has a version of is shown by its versions only.
        return [best[k] for k in sorted(best, key=lambda k: (k[0], _version_key(k[1]))) if k[1]
                or k[0] not in versioned]

    def resolve(self, name: str, version: str = "", visible: Callable[[str], bool] | None = None) -> pb.ModelInfo:
        """The served ModelInfo for name/version ('' = the latest version). `visible`: which model
        names the caller may learn of (a token's scope); a refusal names no other."""
        versions = self.versions(name)
        if not versions:
            # (Why a model serves no version, when the repository says, is gateway/repository.py's absent.)
            served = ", ".join(n for n in self.model_names() if visible is None or visible(n)) or "none"
            # Triton's wording up to the colon: its example clients look for it.
            raise NotFound(f"Request for unknown model: '{name}' is not served by any live executor (served models: "
                           f"{served})")
        if not version:
            version = versions[-1]
        if not version.isdigit():
            raise InvalidArgument(f"failed to get model version from specified version string '{version}': a version "
                                  f"is a number (model '{name}' has {', '.join(versions)}), or empty for the latest")
        if (name, version) not in self.holders:
            raise NotFound(f"model '{name}' has no version '{version}' (available: {', '.join(versions)})")
        return self.models[(name, version)]
