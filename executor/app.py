"""Wiring of the executor service: repository, gRPC control server, work loop."""
from __future__ import annotations

import asyncio
import logging
import time
import uuid

from batchline import contract, metrics
from batchline.contract.keys import ModelKey
from batchline.lifecycle import stop_tasks
from batchline.grpc_server import ServerHandle, start_server
from batchline.protocol import internal_pb2, internal_pb2_grpc
from batchline.protocol import internal_pb2 as pb
from batchline.redis_client import REDIS_ERRORS
from executor.generation_serving import GenerationModel
from executor.live import LiveRepository
from executor.repository import LoadedModel
from executor.control import ExecutorControl
from executor.service import Executor
from executor.settings import ExecutorSettings

log = logging.getLogger(__name__)

# Attempts to give a new Redis primary the finished batches it lacks, this far apart.
REWRITE_ATTEMPTS = 10
REWRITE_RETRY_S = 0.2


def lane_id(executor_id: str, lane: int) -> str:
    return executor_id if lane == 0 else f"{executor_id}#{lane}"


def executor_lanes(settings: ExecutorSettings, models: list[LoadedModel]) -> list[Executor]:
    """One Executor per lane: lane i holds the models with more than i instances.

    To the scheduler each lane is an executor of its own (its own id, work list and
    registration), so a model with instance_count 2 gets two batches planned and run
    at once, each predicted from the same latency profile. Lane 0 holds every model
    and keeps the configured executor id.
    """
    base = settings.executor_id or f"exec-{uuid.uuid4().hex[:12]}"
    lanes = max([m.instances for m in models], default=1)
    return [Executor(settings, [m for m in models if m.instances > i], lane_id(base, i)) for i in range(lanes)]


class ExecutorApp:
    def __init__(self, settings: ExecutorSettings, started_s: float | None = None):
        """`started_s`: when the executor began starting (epoch s; default now), which its
        registrations' start-to-serving time counts from."""
        self.settings = settings
        self.started_s = time.time() if started_s is None else started_s
        self.lanes: list[Executor] = []
        self.server: ServerHandle | None = None
        self._health: asyncio.Task | None = None
        self._follow: asyncio.Task | None = None
        self.metrics_port = -1
        self.repository = LiveRepository(self)
        self._address = ""
        self._rewriting: set[asyncio.Task] = set()
        # Generative versions replaced or released here whose sequences still end on them.
        self._retiring: dict[asyncio.Task, GenerationModel] = {}

    @property
    def executor(self) -> Executor | None:
        """The first lane: it holds every model and keeps the configured id."""
        return self.lanes[0] if self.lanes else None

    @property
    def generators(self) -> list[GenerationModel]:
        """The generative versions served (the first lane runs their batches)."""
        return list(self.executor.generators.values()) if self.executor else []

    @property
    def port(self) -> int:
        return self.server.port

    async def start(self) -> "ExecutorApp":
        s = self.settings
        loaded = await self.repository.initial()
        models = [m for m in loaded if isinstance(m, LoadedModel)]
        generators = [m for m in loaded if isinstance(m, GenerationModel)]
        for generator in generators:
            await generator.loop.__aenter__()
        self.lanes = executor_lanes(s, models)
        self.executor.generators = {(g.name, g.version): g for g in generators}
        for model in models:
            _report_provider(model)
        self.executor.catalog = self._catalog
        if s.warmup:
            await asyncio.to_thread(self.executor.warmup)

        def register(server):
            internal_pb2_grpc.add_ExecutorServicer_to_server(ExecutorControl(self.lanes), server)
            return [internal_pb2.DESCRIPTOR.services_by_name["Executor"].full_name]

        self.metrics_port = metrics.start_metrics_server(self.settings.host, self.settings.metrics_port)
        self.server = await start_server(s.host, s.port, register)
        self._address = f"{s.host}:{self.server.port}"
        for lane in self.lanes:
            lane.start_s = time.time() - self.started_s
            await lane.start(self._address)
        self._health = asyncio.create_task(self.server.watch_redis(
            self.executor.store, on_change=self._redis_trouble, on_restart=self._new_primary))
        self._follow = asyncio.create_task(self.repository.run(), name="repository")
        return self

    def _redis_trouble(self, up: bool = False) -> None:
        """Redis went away, came back or changed primary: the lanes distrust missing heartbeats a while."""
        for lane in self.lanes:
            lane.heartbeats.redis_trouble()

    def _new_primary(self) -> None:
        self._redis_trouble()
        task = asyncio.create_task(self._rewrite_lost(), name="rewrite")
        self._rewriting.add(task)
        task.add_done_callback(self._rewriting.discard)

    async def _rewrite_lost(self) -> None:
        """Give a new Redis primary the finished batches it lacks (their answers were acknowledged by
        the old one but not replicated), so that their requests are answered instead of waiting."""
        cluster = contract.on_cluster(self.executor.store.client)
        for _ in range(REWRITE_ATTEMPTS):
            try:
                n = sum([await lane.written.rewrite_lost(lane.store, resend_answers=cluster) for lane in self.lanes])
            except REDIS_ERRORS as exc:
                log.warning("writing finished batches to the new Redis primary failed: %s", exc)
                await asyncio.sleep(REWRITE_RETRY_S)
                continue
            metrics.BATCHES_REWRITTEN.inc(n)
            if n:
                log.warning("the new Redis primary lacked %d finished batches: written again", n)
            return

    # -- the live repository's hands (executor/live.py) ---------------------

    def _catalog(self) -> tuple[list[pb.RepositoryEntry], str, dict[str, int]]:
        return self.repository.entries(), self.settings.model_control_mode, dict(self.repository.applied)

    async def place(self, model: LoadedModel | GenerationModel) -> None:
        """Serve `model` on its lanes (one per instance), replacing a loaded copy of the same version."""
        key = (model.name, model.version)
        if isinstance(model, GenerationModel):
            await model.loop.__aenter__()
            replaced = self.executor.generators.get(key)
            self.executor.generators[key] = model
            self.executor.released.pop(key, None)
            if replaced is not None:
                # New sequences start on the new engine; those running end on the old one, as a
                # reloaded model's batches in flight finish on the session they started on.
                self._retire(replaced, None)
            return
        await self.executor.publish_tokenizers([model])  # before a gateway can see the model
        _report_provider(model)
        while len(self.lanes) < model.instances:
            lane = Executor(self.settings, [], lane_id(self.executor.executor_id, len(self.lanes)))
            self.lanes.append(lane)
            await lane.start(self._address)
        for i, lane in enumerate(self.lanes):
            if i < model.instances:
                lane.models[key] = model
                lane.released.pop(key, None)
            elif key in lane.models:
                self._drop(lane, key)

    def mark_unloading(self, key: ModelKey, unloading: bool = True) -> None:
        for lane in self.lanes:
            if key in lane.models:
                lane.models[key].info.unloading = unloading
        if key in self.executor.generators:
            self.executor.generators[key].info.unloading = unloading

    def release(self, key: ModelKey) -> None:
        _report_provider(None, key)
        generator = self.executor.generators.pop(key, None)
        if generator is not None:
            self.executor.released[key] = time.monotonic()
            timeout = self.settings.drain_timeout_s
            self._retire(generator, timeout, f"model '{key[0]}' version {key[1]} was unloaded from executor "
                         f"{self.executor.executor_id} while this request generated (its sequences had "
                         f"{timeout:g} s to end); the tokens made were sent: send the rest again as a new request")
        for lane in self.lanes:
            if key in lane.models:
                self._drop(lane, key)

    def _retire(self, model: GenerationModel, end_after_s: float | None, message: str = "") -> None:
        task = asyncio.create_task(model.retire(end_after_s, message), name=f"retire-{model.name}-{model.version}")
        self._retiring[task] = model
        task.add_done_callback(lambda t: self._retiring.pop(t, None))

    @staticmethod
    def _drop(lane: Executor, key: ModelKey) -> None:
        del lane.models[key]
        lane.released[key] = time.monotonic()

    async def announce(self) -> None:
        """Register every lane now, so that the gateways and the scheduler see the change at their next read."""
        await asyncio.gather(*(lane.register() for lane in self.lanes))

    async def publish_reports(self, reports: list[pb.ExecutionReport]) -> None:
        await self.executor.publish_reports(reports)

    async def stop(self, grace: float = 2.0) -> None:
        """Drain (finish or hand back the batches sent here), then deregister and stop."""
        if self.server:
            await self.server.start_draining()
        if self._health:
            await stop_tasks([self._health, self._follow])
        if self.lanes:
            await asyncio.gather(*(lane.drain(self.settings.drain_timeout_s) for lane in self.lanes))
            await asyncio.gather(*(lane.stop() for lane in self.lanes))
        if self.server:
            await self.server.stop(grace)
        retiring = list(self._retiring.values())
        await stop_tasks(list(self._retiring))
        for generator in self.generators + retiring:
            await generator.loop.__aexit__(None, None, None)
        metrics.stop_metrics_server(self.metrics_port)
        self.repository.overrides.close()


# The provider each placed version's gauge names, to clear it on release or replacement.
_PROVIDERS: dict[ModelKey, str] = {}


def _report_provider(model: LoadedModel | None, key: ModelKey | None = None) -> None:
    """The provider gauge of a version placed (`model`), or of one released (`key`)."""
    if model is not None:
        key = (model.name, model.version)
    old = _PROVIDERS.pop(key, None)
    if old is not None:
        metrics.MODEL_PROVIDER.remove(*key, old)
    if model is not None and model.info.providers:
        _PROVIDERS[key] = model.info.providers[0]
        metrics.MODEL_PROVIDER.labels(*key, _PROVIDERS[key]).set(1)
