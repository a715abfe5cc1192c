"""The generation engine driven from an asyncio loop: steps in a worker thread, tokens to each request's stream.

ONNX Runtime's runs block, so each `GenerationEngine.step` runs on one worker thread; the loop
changes the engine (adds, cancels) only between steps, so the engine needs no lock. A request's
outputs reach its caller through an asyncio queue as its steps finish.
"""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Callable

from executor.generation_engine import GenerationEngine, Output, StepReport
from executor.generation_sampling import SamplingParams


class GenerationLoop:
    def __init__(self, engine: GenerationEngine, clock: Callable[[], float] | None = None,
                 on_step: Callable[[StepReport, float], None] | None = None) -> None:
        """`on_step`: told each step's report and its seconds, on the event loop (the executor's metrics
        and learned costs)."""
        self.engine = engine
        self._clock = clock
        self._on_step = on_step
        self._streams: dict[str, asyncio.Queue[Output]] = {}
        self._pending: list[tuple[str, list[int], SamplingParams, int, float, list[int]]] = []
        self._cancels: list[str] = []
        self._wake = asyncio.Event()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="generation")
        self._task: asyncio.Task[None] | None = None
        self.steps = 0

    async def __aenter__(self) -> "GenerationLoop":
        self._task = asyncio.create_task(self._run(), name="generation-loop")
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        # The step running in the thread, if any, finishes there: waited for off the event loop, which
        # serves the other models' streams and the heartbeat meanwhile.
        await asyncio.to_thread(self._thread.shutdown, True)
        # No step comes any more, the one that would have retired the sequences cancelled meanwhile included.
        self.engine.drop_all()

    def generating(self, request_id: str) -> bool:
        """Whether a stream of this request id is open here."""
        return request_id in self._streams

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                       priority: int = 1, output: list[int] | None = None,
                       idle: Callable[[], float | None] | None = None) -> AsyncIterator[Output | None]:
        """The sequence's outputs as its steps make them, the last one finished. Leaving the iteration early
        cancels the sequence, which frees its cache at the next step. `output`: tokens it already made
        elsewhere, which it continues from (GenerationEngine.add). `idle`: how long the caller may wait
        for the next output before it must act (None: as long as it takes); when that passes with
        none, None comes instead (a slow step, or the sequence preempted and waiting)."""
        if self._task is None or self._task.done():
            raise RuntimeError("the generation loop is not running (use it as `async with`)")
        if self.generating(request_id):
            # Checked before anything is registered or queued: the stream already here, its queue and
            # its sequence are left alone.
            raise ValueError(f"request id {request_id!r} is already generating on this executor")
        queue: asyncio.Queue[Output] = asyncio.Queue()
        self._streams[request_id] = queue
        now = self._clock() if self._clock else asyncio.get_running_loop().time()
        self._pending.append((request_id, prompt, params, priority, now, list(output or [])))
        self._wake.set()
        finished = False
        try:
            while not finished:
                wait = idle() if idle is not None else None
                if wait is None or not queue.empty():
                    out = await queue.get()
                else:
                    try:
                        out = await asyncio.wait_for(queue.get(), wait)
                    except TimeoutError:
                        yield None
                        continue
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
        finally:
            if not finished:
                self._cancels.append(request_id)
                self._wake.set()
            self._streams.pop(request_id, None)

    def _take_changes(self) -> None:
        # Cancels first: they are of streams already closed, and a request's id may come again
        # (recovery hands a batch back) with a stream of its own that they must not end.
        for request_id in self._cancels:
            self.engine.cancel(request_id)
        self._cancels.clear()
        pending, self._pending = self._pending, []
        for request_id, prompt, params, priority, arrival, output in pending:
            if request_id not in self._streams:
                continue  # its stream closed before it started: nobody would read it
            try:
                self.engine.add(request_id, prompt, params, priority, arrival, output)
            except ValueError as exc:
                self._streams[request_id].put_nowait(exc)  # type: ignore[arg-type]

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._take_changes()
            if not self.engine.has_work:
                self._wake.clear()
                await self._wake.wait()
                continue
            started = time.perf_counter()
            try:
                report: StepReport = await loop.run_in_executor(self._thread, self.engine.step)
            except Exception as exc:  # noqa: BLE001 - a failed run ends every sequence in it, not the loop
                # The model's run, not any one request, failed: no ValueError that would blame the caller.
                error = RuntimeError(f"the model's run failed ({type(exc).__name__}: {exc})")
                for request_id in self.engine.drop_running():
                    queue = self._streams.get(request_id)
                    if queue is not None:
                        queue.put_nowait(error)  # type: ignore[arg-type]
                continue
            self.steps += 1
            if self._on_step is not None:
                self._on_step(report, time.perf_counter() - started)
            for out in report.outputs:
                queue = self._streams.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)
            for request_id, exc in report.failed:
                queue = self._streams.get(request_id)
                if queue is not None:
                    queue.put_nowait(exc)  # type: ignore[arg-type]
