"""Triton's model repository extension, in domain terms: the index, load and unload.

The executors own the repository: each publishes what its copy holds and in what state
(ExecutorInfo.repository), and in explicit mode applies the calls it finds in Redis
(bl:control:models, numbered by bl:control:seq) and reports each one applied
(ExecutorInfo.control_applied). A call here writes the request and waits for those reports.
"""
from __future__ import annotations

import asyncio
import time

from batchline.contract.gateway_store import GatewayStore

from batchline.errors import InvalidArgument, NotFound, Unavailable
from batchline.protocol import internal_pb2 as pb
from batchline.redis_client import REDIS_ERRORS, unreachable
from batchline.registry import Registry, model_name_problem
from gateway.load_override import override_maker

# How often a load or unload looks whether the executors have applied it.
WAIT_POLL_S = 0.05
# The longest a load or unload waits when the client set no deadline (a TensorRT build can take minutes).
DEFAULT_TIMEOUT_S = 600.0


def absent(registry: Registry, name: str) -> Exception | None:
    """Why a model that serves no version is not served, if the repository says (None: it does not)."""
    entries = [e for e in registry.repository() if e.name == name]
    states = {e.state for e in entries}
    if registry.releasing(name) or "UNLOADING" in states:
        return NotFound(f"model '{name}' is being unloaded: it takes no new requests")
    if "LOADING" in states:
        return Unavailable(f"model '{name}' is loading: retry in a moment")
    reasons = sorted({e.reason for e in entries if e.state == "UNAVAILABLE" and e.reason})
    if reasons == ["unloaded"]:
        return NotFound(f"model '{name}' is unloaded: load it with RepositoryModelLoad to serve it again")
    if reasons:
        return NotFound(f"model '{name}' failed to load: {'; '.join(reasons)}")
    if entries and "READY" not in states:
        return NotFound(f"model '{name}' is in the repository but not loaded: load it with RepositoryModelLoad")
    return None


def _loaded(info: pb.ExecutorInfo, name: str) -> bool:
    """The executor serves `name` and every version it selected loaded (a failed one has a reason)."""
    entries = [e for e in info.repository if e.name == name]
    return any(e.state == "READY" for e in entries) and not any(e.reason and e.reason != "unloaded" for e in entries)


class RepositoryControl:
    def __init__(self, store: GatewayStore, mode: str, max_override_bytes: int):
        self.store = store
        self.mode = mode
        self.max_override_bytes = max_override_bytes

    async def index(self, ready_only: bool) -> list[pb.RepositoryEntry]:
        registry = await self._registry()
        entries = registry.repository()
        return [e for e in entries if e.state == "READY"] if ready_only else entries

    async def load(self, name: str, parameters: dict, timeout_s: float | None) -> None:
        """Load (or re-read) `name` on every explicit-mode executor, with the call's config and
        files when it has them (gateway/load_override.py); returns once one serves it."""
        self._explicit("load", name)
        seq = await self._call(name, "load", override_maker(name, parameters, self.max_override_bytes))
        await self._wait(name, seq, timeout_s, "load", lambda info: _loaded(info, name))

    async def unload(self, name: str, timeout_s: float | None) -> None:
        """Unload `name` on every explicit-mode executor: each stops taking its requests, finishes what
        is queued and releases it. Returns once every one has begun."""
        seq = await self._call(name, "unload")
        await self._wait(name, seq, timeout_s, "unload", None)

    # -----------------------------------------------------------------------

    def _explicit(self, what: str, name: str) -> None:
        if self.mode != "explicit":
            raise Unavailable(f"explicit model {what} is not allowed: the gateway runs with --model-control-mode "
                              f"{self.mode} (start the mesh with --model-control-mode explicit to {what} '{name}')")

    async def _registry(self) -> Registry:
        try:
            return await Registry.load(self.store)
        except REDIS_ERRORS as exc:
            raise Unavailable(unreachable(exc)) from None

    async def _call(self, name: str, action: str, override=None) -> int:
        self._explicit(action, name)
        problem = model_name_problem(name)
        if problem is not None:
            raise InvalidArgument(f"model name {name!r} is not a model's name: {problem}")
        try:
            seq = await self.store.control_call(name, action, override)
        except REDIS_ERRORS as exc:
            raise Unavailable(unreachable(exc)) from None
        return seq

    async def _wait(self, name: str, seq: int, timeout_s: float | None, what: str, served) -> None:
        """Until the executors have applied call `seq`: a load returns as soon as one serves the model."""
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else DEFAULT_TIMEOUT_S)
        while True:
            registry = await self._registry()
            explicit = [i for i in registry.executors.values() if i.model_control_mode == "explicit"]
            if not explicit:
                raise Unavailable("no live executor runs with --model-control-mode explicit: "
                                  f"none would {what} '{name}'")
            applied = [i for i in explicit if i.control_applied.get(name, 0) >= seq]
            if served is not None and any(served(i) for i in applied):
                return
            if len(applied) == len(explicit):
                listed = [e for i in explicit for e in i.repository if e.name == name]
                if not listed:
                    raise NotFound(f"failed to {what} '{name}': it is not in the model repository of any executor")
                if served is None:
                    return
                reasons = sorted({f"version {e.version}: {e.reason}" if e.version else e.reason
                                  for e in listed if e.reason})
                why = "; ".join(reasons) or "no version directory to load"
                raise InvalidArgument(f"failed to load '{name}': {why}")
            if time.monotonic() >= deadline:
                raise Unavailable(f"the {what} of '{name}' was asked for, but {len(explicit) - len(applied)} of "
                                  f"{len(explicit)} executors have not finished it yet: see RepositoryIndex")
            await asyncio.sleep(WAIT_POLL_S)
