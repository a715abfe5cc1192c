"""The mesh in one process, for tests: real gateway, scheduler and executors on port 0.

The services run on their own event loop in a background thread, so tests
can drive them with the synchronous tritonclient as well as the aio one.
"""
from __future__ import annotations

import asyncio
import threading
import uuid
from concurrent.futures import Future

from batchline.embedded_redis import EmbeddedRedis
from batchline.redis_client import connect_sync
from executor.app import ExecutorApp
from executor.settings import ExecutorSettings
from gateway.app import GatewayApp
from gateway.settings import GatewaySettings
from scheduler.app import SchedulerApp
from scheduler.settings import SchedulerSettings


class InProcessMesh:
    def __init__(self, redis_url: str | None, model_repository: str, executors: int = 1,
                 models: list[str] | None = None, gateway_overrides: dict | None = None,
                 executor_overrides: dict | None = None, **scheduler_overrides):
        # Without a URL the mesh gets a Redis of its own, so meshes never see each other's queues.
        self.own_redis = None if redis_url else EmbeddedRedis().start()
        self.redis_url = redis_url or self.own_redis.url
        self.gateway_overrides = gateway_overrides or {}
        self.executor_overrides = executor_overrides or {}
        self.repo = model_repository
        self.n_executors = executors
        self.models = models or []
        self.scheduler_overrides = scheduler_overrides
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="mesh")
        self.gateway: GatewayApp | None = None
        self.scheduler: SchedulerApp | None = None
        self.executors: list[ExecutorApp] = []

    def call(self, coro, timeout: float = 120):
        fut: Future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout)
        except TimeoutError:
            # Say where the mesh is stuck: every task's stack on its loop.
            for task in asyncio.all_tasks(self.loop):
                chain, coro = [], task.get_coro()
                while coro is not None and hasattr(coro, "cr_frame") and coro.cr_frame is not None:
                    f = coro.cr_frame
                    chain.append(f"{f.f_code.co_filename.rsplit('/', 2)[-1]}:{f.f_lineno} {f.f_code.co_name}")
                    coro = coro.cr_await
                print(f"--- {task.get_name()}: {' -> '.join(chain) or task.get_coro()}")
            raise

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gateway.port}"

    @property
    def http_address(self) -> str:
        """The gateway's REST port, as tritonclient.http takes it."""
        return f"127.0.0.1:{self.gateway.http_port}"

    def start(self) -> "InProcessMesh":
        connect_sync(self.redis_url, 2).flushdb()
        self.thread.start()
        self.call(self._start())
        return self

    async def _start(self) -> None:
        for i in range(self.n_executors):
            self.executors.append(await self._start_executor(i))
        self.scheduler = await SchedulerApp(
            SchedulerSettings(redis_url=self.redis_url, port=0, metrics_port=-1, **self.scheduler_overrides)
        ).start()
        gateway = {"drain_timeout_s": 5.0, "http_port": 0, **self.gateway_overrides}
        self.gateway = await GatewayApp(GatewaySettings(redis_url=self.redis_url, port=0, metrics_port=-1,
                                                        **gateway)).start()

    async def _start_executor(self, i: int) -> ExecutorApp:
        settings = ExecutorSettings(
            redis_url=self.redis_url,
            model_repository=self.repo,
            models=self.models,
            port=0,
            metrics_port=-1,
            executor_id=f"test-exec-{i}-{uuid.uuid4().hex[:6]}",
            intra_op_threads=1,
            **self.executor_overrides,
        )
        return await ExecutorApp(settings).start()

    def stop(self) -> None:
        async def _stop():
            if self.gateway:
                await self.gateway.stop(0)
            if self.scheduler:
                await self.scheduler.stop(0)
            for e in self.executors:
                await e.stop(0)

        try:
            self.call(_stop(), timeout=30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            if self.own_redis:
                self.own_redis.close()

    def __enter__(self) -> "InProcessMesh":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
