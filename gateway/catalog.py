"""The models this gateway serves, as the executors' registrations in Redis say: lookups by name
and version, the labels of a request's metrics, readiness and statistics."""
from __future__ import annotations

import asyncio
from typing import Callable

from batchline.contract.gateway_store import GatewayStore

from batchline.errors import InvalidArgument, NotFound, Unavailable
from batchline.protocol import internal_pb2 as pb
from batchline.redis_client import REDIS_ERRORS, unreachable
from batchline.registry import Registry
from gateway.repository import absent


class Catalog:
    def __init__(self, store: GatewayStore):
        self.store = store
        self.registry = Registry()
        self._served: set[str] = set()  # model names ever served: their absence is UNAVAILABLE, not NOT_FOUND
        self._loading: asyncio.Future | None = None  # the registry read under way, which others share
        self._reads = 0                 # registry reads begun
        self._began: int | None = None  # the number of the read under way (None: not begun yet)

    async def refresh(self) -> None:
        """Read the registry again. A call shares a read under way that began after it was made (a
        flood of requests for names nobody serves costs Redis one read at a time, not one each); one
        that began before may miss what changed since (a model just loaded or unloaded), so the call
        waits for it and then shares the next."""
        called = self._reads
        while True:
            loading = self._loading
            if loading is None or loading.done():
                loading = self._loading = asyncio.ensure_future(self._load())
                self._began = None
                # Read even when every caller that waited for it went away meanwhile.
                loading.add_done_callback(lambda f: f.cancelled() or f.exception())
            elif self._began is not None and self._began <= called:
                await asyncio.wait([loading])
                continue
            registry = await asyncio.shield(loading)
            break
        self.registry = registry
        self._served.update(registry.model_names())

    async def _load(self) -> Registry:
        self._reads += 1
        self._began = self._reads
        return await Registry.load(self.store)

    async def refresh_or_unavailable(self) -> None:
        try:
            await self.refresh()
        except REDIS_ERRORS as exc:
            raise Unavailable(unreachable(exc)) from None

    def labels(self, name: str, version: str = "") -> tuple[str, str]:
        """The (model, version) labels of a request's metrics: resolved as its answer's would be.

        A client that names no version is counted under the version that serves it, so that
        failures and successes of one model line up; a name never served counts under "" so that
        unknown names do not add series without bound.
        """
        try:
            info = self.registry.resolve(name, version)
            return info.name, info.version
        except (NotFound, InvalidArgument):  # (a version that is no number: counted as an unknown one)
            return (name, "") if name in self._served else ("", "")

    async def model(self, name: str, version: str = "", visible: Callable[[str], bool] | None = None) -> pb.ModelInfo:
        """The served model (NotFound, Unavailable); `visible`: the names a refusal may list (a token's scope)."""
        try:
            return self.registry.resolve(name, version, visible)
        except NotFound:
            # An executor may have registered since the last refresh.
            await self.refresh_or_unavailable()
            try:
                return self.registry.resolve(name, version, visible)
            except NotFound:
                why = absent(self.registry, name) if not self.registry.versions(name) else None
                if why is not None:
                    raise why from None
                if name in self._served and not self.registry.versions(name):
                    # Served before: its executors are restarting or re-registering (e.g. Redis restarted).
                    raise Unavailable(f"no live executor serves model '{name}' right now "
                                      "(it was served before): retry") from None
                raise

    async def ready(self) -> bool:
        """Ready when Redis answers and at least one live executor serves a model."""
        try:
            if not self.registry.models:
                await self.refresh()
            else:
                await self.store.ping()
        except REDIS_ERRORS:
            return False
        return bool(self.registry.models)

    async def model_ready(self, name: str, version: str) -> bool:
        try:
            await self.model(name, version)
        except (NotFound, Unavailable):
            return False
        return True

    async def statistics(self, name: str, version: str, visible: Callable[[str], bool] | None = None,
                         ) -> list[tuple[pb.ModelInfo, dict[str, int]]]:
        """Each served version's counters (every version of `name` when `version` is empty, every
        model `visible` lets the caller see when `name` is)."""
        if name:
            first = await self.model(name, version, visible)
            # Like Triton: no version means every served version.
            versions = [version] if version else self.registry.versions(name)
            models = [first] if version else [self.registry.models[(name, v)] for v in versions]
        else:
            await self.refresh_or_unavailable()
            models = [self.registry.models[k] for k in sorted(self.registry.models)
                      if visible is None or visible(k[0])]
        try:
            counters = await self.store.statistics([(m.name, m.version) for m in models])
        except REDIS_ERRORS as exc:
            raise Unavailable(unreachable(exc)) from None
        return list(zip(models, counters))
