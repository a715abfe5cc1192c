"""The live model repository of one executor process: which versions it serves, loaded and
released while it serves (Triton's model control modes).

- none: what the repository holds at start, under each model's version_policy; a model that
  fails to load stops the executor.
- poll: the same at start, then the repository is re-scanned every repository_poll_s: a version
  the policy newly selects (or whose files changed) is loaded, one it no longer selects is released.
- explicit: the models of load_model at start, then what RepositoryModelLoad / Unload ask for
  through Redis (bl:control:models, each call numbered by bl:control:seq); each call applied is
  reported back in the registration (control_applied), which is what a gateway's call waits for.

A version is loaded, warmed up (its latency profile seeded) and only then advertised. A version
being released is advertised as unloading: gateways admit no new requests to it, the scheduler
sends it only what was queued while no other executor serves it, and after UNLOAD_GRACE_S, once
its queue is empty (or another executor serves it) and no batch of it is here, it is dropped.

Generative models (config.toml [generation]) are loaded, reloaded and released the same way, into
a generation engine each (executor/generation_serving.py), with two differences: their sequences
run for as long as their answers, so a version is released while sequences still generate, and
those have the executor's drain_timeout_s to end before they are ended UNAVAILABLE; and a reload
leaves the sequences running on the engine they started on, which stops when the last one ends.
"""
from __future__ import annotations

import asyncio
import logging
import os
import pathlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from batchline import contract
from batchline.contract.executor_store import ExecutorStore
from batchline.contract.keys import ModelKey
from batchline.protocol import internal_pb2 as pb
from batchline.redis_client import REDIS_ERRORS, connect
from batchline.registry import Registry, model_name_problem
from executor.generation_serving import GenerationModel, generation_names, load_generation, load_generation_models
from executor.repository import (
    LoadedModel, ModelDir, RepositoryError, load_model, load_repository, model_names, scan_model,
)
from executor.load_override import OVERRIDE_JSON, Overrides
from executor.model_config import ConfigError, declares_generation
from executor.service import until_redis
from executor.warmup import warm_up

if TYPE_CHECKING:
    from executor.app import ExecutorApp

log = logging.getLogger(__name__)

READY, LOADING, UNLOADING, UNAVAILABLE = "READY", "LOADING", "UNLOADING", "UNAVAILABLE"
UNLOADED = "unloaded"  # the reason of a version released here (Triton's word)
CONTROL_POLL_S = 0.25  # explicit mode: how often the repository calls are read; also the release check


@dataclass
class Slot:
    """One version of a model on this executor."""
    state: str
    reason: str = ""
    fingerprint: tuple[int, ...] = ()
    since: float = 0.0  # time.monotonic() it entered the state
    failed: tuple[int, ...] = ()  # the files a reload of it failed on (what serves is `fingerprint`'s)


class LiveRepository:
    def __init__(self, app: "ExecutorApp"):
        self.app = app
        self.settings = app.settings
        self.root = pathlib.Path(self.settings.model_repository)
        self.mode = self.settings.model_control_mode
        self.slots: dict[ModelKey, Slot] = {}
        self.notes: dict[str, str] = {}      # model -> why none of its versions serves ("unloaded", a config error)
        self.listed: set[str] = set()        # model directories of the repository at the last scan
        self.applied: dict[str, int] = {}    # model -> sequence number of the last repository call applied
        self._locks: dict[str, asyncio.Lock] = {}
        # The models loaded with a load call's config and files.
        self.overrides = Overrides(self.settings.executor_id or f"pid{os.getpid()}")

    # -- what the registration shows ------------------------------------

    def entries(self) -> list[pb.RepositoryEntry]:
        out = []
        for name in sorted(self.listed | {n for n, _ in self.slots}):
            versions = sorted((v for n, v in self.slots if n == name), key=lambda v: (len(v), v))
            for v in versions:
                slot = self.slots[(name, v)]
                out.append(pb.RepositoryEntry(name=name, version=v, state=slot.state, reason=slot.reason))
            if not versions:
                note = self.notes.get(name, "")
                out.append(pb.RepositoryEntry(name=name, state=UNAVAILABLE if note else "", reason=note))
        return out

    # -- start ------------------------------------------------------------

    async def initial(self) -> list[LoadedModel | GenerationModel]:
        """The models to serve from the start (loaded, not yet warmed up or placed)."""
        s = self.settings
        names = await asyncio.to_thread(self._names)
        self.listed = set(names)
        if self.mode == "none":  # all of it, or nothing: a model that fails stops the executor
            models: list[LoadedModel | GenerationModel] = [*await asyncio.to_thread(
                load_repository, self.root, s.models or None, s.providers, s.trt_engine_cache_dir, s.intra_op_threads,
                s.allow_spinning, s.cpu_cores)]
            models += await asyncio.to_thread(load_generation_models, s)
            self.slots = {(m.name, m.version): Slot(READY, fingerprint=m.fingerprint, since=time.monotonic())
                          for m in models}
            return models
        if self.mode == "explicit":
            wanted = [n for n in s.load_model if not s.models or n in s.models]
            # Before the lanes (and their Redis clients) exist: a client of its own for these reads.
            store = ExecutorStore(connect(s.redis_url, s.redis_timeout_s))
            try:
                calls = await until_redis("reading the repository calls", store.control_calls)
                for name, (action, seq) in calls.items():
                    self.applied[name] = seq
                    if self._not_ours(name, seq):
                        continue  # as follow_calls leaves it
                    if action == "load" and not await self._override(name, seq, store):
                        continue
                    if action == "load" and name not in wanted:
                        wanted.append(name)
                    elif action == "unload" and name in wanted:
                        wanted.remove(name)
                        self.notes[name] = UNLOADED
            finally:
                await store.aclose()
            names = wanted
        models = []
        for name in names:
            try:
                scanned = await asyncio.to_thread(self._scan, name)
            except RepositoryError as exc:
                self._failed(name, str(exc))
                continue
            for version, print_ in scanned.versions.items():
                try:  # a version that fails, fails alone: the model's others load
                    models.append(await self._load(scanned, version, print_))
                except RepositoryError as exc:
                    self._failed(name, str(exc))
        return models

    async def run(self) -> None:
        """Follow the repository (poll) or the repository calls (explicit); release what is unloading."""
        polled = time.monotonic()
        while True:
            await asyncio.sleep(CONTROL_POLL_S)
            try:
                if self.mode == "poll" and time.monotonic() - polled >= self.settings.repository_poll_s:
                    polled = time.monotonic()
                    await self.poll()
                elif self.mode == "explicit":
                    await self.follow_calls()
                await self.release_finished()
            except REDIS_ERRORS as exc:
                log.warning("model repository: Redis failed (%s); trying again", exc)
            except Exception:  # the repository loop must outlive one bad scan
                log.exception("model repository: a scan failed")

    # -- changes ------------------------------------------------------------

    async def poll(self) -> None:
        names = await asyncio.to_thread(self._names)
        self.listed = set(names)
        for name in sorted(set(names) | {n for n, _ in self.slots}):
            await self.sync(name)

    async def follow_calls(self) -> None:
        calls = await self.app.executor.store.control_calls()
        for name, (action, seq) in sorted(calls.items(), key=lambda kv: kv[1][1]):
            if seq <= self.applied.get(name, 0):
                continue
            if self._not_ours(name, seq):
                pass  # applied, so that no caller waits for it
            elif action == "load":
                if await self._override(name, seq, self.app.executor.store):
                    names = await asyncio.to_thread(self._names)
                    self.listed = set(names) | set(self.overrides.dirs)
                    await self.sync(name)
            else:
                self.unload(name)
            self.applied[name] = seq
            await self.app.announce()

    async def sync(self, name: str) -> None:
        """Bring one model to what its directory and version_policy say now."""
        async with self._locks.setdefault(name, asyncio.Lock()):
            try:
                scanned = await asyncio.to_thread(self._scan, name)
            except RepositoryError as exc:
                if not self._dir(name).is_dir():
                    self.listed.discard(name)
                    if self._unload_versions(name, {}):
                        await self.app.announce()  # advertised as unloading before its grace runs out
                    return
                self._failed(name, str(exc))
                return
            if self._config_vanished(name, scanned):
                log.warning("model %s: its config.toml is gone (being rewritten?): what serves stays as it is", name)
                return
            self.notes.pop(name, None)
            for version, print_ in scanned.versions.items():
                slot = self.slots.get((name, version))
                # A version that failed is tried again when its files change (or on an explicit load);
                # so is a reload that failed, its old files serving meanwhile.
                changed = slot is not None and slot.fingerprint != print_ and (
                    slot.failed != print_ or self.mode == "explicit")
                if slot is None or changed or slot.state == UNLOADING or (
                        slot.state == UNAVAILABLE and (self.mode == "explicit" or slot.reason == UNLOADED)):
                    await self._load_and_place(scanned, version, print_)
            if any(self.slots.get((name, v), Slot("")).state == READY for v in scanned.versions):
                if self._unload_versions(name, scanned.versions):
                    await self.app.announce()

    def _config_vanished(self, name: str, scanned: ModelDir) -> bool:
        """Whether the model serves from a config.toml that is not there now: rewritten by a tool
        that unlinks it first (a moment of every default), not a change to serve."""
        missing = (0, -1)  # repository.fingerprint of a file that is not there
        served = [s for (n, _), s in self.slots.items() if n == name and s.state == READY and s.fingerprint]
        return bool(served) and any(p[:2] == missing for p in scanned.versions.values()) \
            and all(s.fingerprint[:2] != missing for s in served)

    def unload(self, name: str) -> None:
        self._unload_versions(name, {})
        if not any(n == name for n, _ in self.slots):
            self.notes[name] = UNLOADED

    def _unload_versions(self, name: str, keep: dict[str, tuple[int, ...]]) -> bool:
        """Mark the versions of `name` not in `keep` unloading; whether any was (the caller
        announces it: the release's grace counts from now)."""
        unloading = False
        for (n, v), slot in list(self.slots.items()):
            if n != name or v in keep:
                continue
            if slot.state == READY:
                self.slots[(n, v)] = Slot(UNLOADING, fingerprint=slot.fingerprint, since=time.monotonic())
                self.app.mark_unloading((n, v))
                unloading = True
                log.info("unloading %s version %s: it finishes what is queued for it first", n, v)
            elif slot.state == UNAVAILABLE and not (slot.reason == UNLOADED and (self._dir(n) / v).is_dir()):
                del self.slots[(n, v)]  # a failed version, or one whose directory is gone
        return unloading

    async def release_finished(self) -> None:
        for key, slot in list(self.slots.items()):
            if slot.state == UNLOADING and time.monotonic() - slot.since >= contract.UNLOAD_GRACE_S:
                if await self._may_release(key):
                    self.app.release(key)
                    self.slots[key] = Slot(UNAVAILABLE, UNLOADED, slot.fingerprint, time.monotonic())
                    log.info("released %s version %s", *key)
                    await self.app.announce()

    async def _may_release(self, key: ModelKey) -> bool:
        """Nothing of it is queued for this executor: its queue is empty or another executor serves it,
        and no batch of it waits here or runs (read in the order a request moves: queue, work list, run)."""
        store, lanes = self.app.executor.store, self.app.lanes
        depth, works = await store.queued_for(key, [lane.executor_id for lane in lanes])
        for blobs in works:
            for blob in blobs:
                b = pb.Batch.FromString(blob)
                if (b.model_name, b.model_version) == key:
                    return False
        # (A generative version's batches are not counted in `running`: its sequences last as long as
        # their answers, and are left to end after the release, within the drain timeout: ExecutorApp.release.)
        if any(lane.running.get(key) for lane in lanes):
            return False
        if not depth:
            return True
        mine = {lane.executor_id for lane in lanes}
        return any(e not in mine for e in (await Registry.load(store)).holders.get(key, []))

    # -- loading ------------------------------------------------------------

    def _names(self) -> list[str]:
        """The repository's models of both kinds (batches of whole requests, and generative)."""
        only = self.settings.models or None
        return sorted(model_names(self.root, only) + generation_names(self.root, only))

    def _dir(self, name: str) -> pathlib.Path:
        """Where the model's files are: its load call's override, else the repository."""
        return self.overrides.dirs.get(name, self.root / name)

    def _scan(self, name: str) -> ModelDir:
        if name in self.overrides.dirs:
            return scan_model(self.overrides.dirs[name], self.overrides.configs[name], OVERRIDE_JSON)
        return scan_model(self.root / name)

    def _not_ours(self, name: str, seq: int) -> bool:
        """Whether repository call `seq` for `name` is none of this executor's: a model it does not
        serve, or no model's name (the gateway refuses such a call; a write to Redis by hand is not)."""
        if self.settings.models and name not in self.settings.models:
            return True
        problem = model_name_problem(name)
        if problem is not None:
            log.error("repository call %d for %r ignored: %s", seq, name, problem)
        return problem is not None

    async def _override(self, name: str, seq: int, store: ExecutorStore) -> bool:
        """Take load call `seq`'s config and files, if it had any; False when its config cannot be
        served (the call fails with the reason; what serves goes on as it was)."""
        blob = await store.control_override(name)
        try:
            if blob and pb.ModelOverride.FromString(blob).seq == seq and declares_generation(self.root / name):
                raise ConfigError(f"model '{name}' is generative: a load call's config or files do not apply to it "
                                  "(its engine reads config.toml and the tokenizer from the repository); load it "
                                  "without them")
            await asyncio.to_thread(self.overrides.apply, name, blob, seq, self.root)
        except (ConfigError, OSError) as exc:
            # A call's files that cannot be written (a path both a file and a folder) fail that load
            # alone: the calls after it, and the releases, go on.
            self.overrides.drop(name)
            reason = f"a reload failed: {exc}"
            versions = [key for key in self.slots if key[0] == name]
            for key in versions:
                self.slots[key].reason = reason
            if not versions:
                self._failed(name, str(exc))
            log.error("could not load %s: %s", name, exc)
            return False
        for key, slot in self.slots.items():
            # An earlier call's config that failed is no reason against this one.
            if key[0] == name and slot.state == READY and slot.reason.startswith("a reload failed"):
                slot.reason = ""
        return True

    async def _load(self, scanned: ModelDir, version: str, print_: tuple[int, ...]) -> LoadedModel | GenerationModel:
        """The version loaded (RepositoryError with ONNX Runtime's reason if it cannot be)."""
        s = self.settings
        model: LoadedModel | GenerationModel
        try:
            if scanned.config.get("generation") is not None:
                model = await asyncio.to_thread(load_generation, scanned.path, version, s)
            else:
                model = await asyncio.to_thread(
                    load_model, scanned.path, scanned.path / version, scanned.config, s.providers,
                    s.trt_engine_cache_dir, s.intra_op_threads, s.allow_spinning, s.cpu_cores,
                )
        except Exception as exc:
            self.slots[(scanned.name, version)] = Slot(UNAVAILABLE, _load_error(exc), print_, time.monotonic())
            raise RepositoryError(f"{scanned.name} version {version}: {_load_error(exc)}") from exc
        model.fingerprint = print_
        self.slots[(scanned.name, version)] = Slot(READY, fingerprint=print_, since=time.monotonic())
        return model

    async def _load_and_place(self, scanned: ModelDir, version: str, print_: tuple[int, ...]) -> None:
        key = (scanned.name, version)
        serving = self.slots.get(key)
        if serving is not None and serving.state == UNLOADING and serving.fingerprint == print_:
            # Selected again before it was released: it serves on as it is.
            self.slots[key] = Slot(READY, fingerprint=print_, since=time.monotonic())
            self.app.mark_unloading(key, False)
            return
        serving = serving if serving is not None and serving.state in (READY, UNLOADING) else None
        if serving is None:
            self.slots[key] = Slot(LOADING, fingerprint=print_, since=time.monotonic())
        try:
            model = await self._load(scanned, version, print_)
            if self.settings.warmup and isinstance(model, LoadedModel):  # (the engine learns its costs as it runs)
                if serving is None:
                    self.slots[key].state = LOADING  # not served before its profile is seeded
                reports = await asyncio.to_thread(warm_up, model, self.app.executor.executor_id)
                await self.app.publish_reports(reports)
                self.slots[key].state = READY
        except Exception as exc:  # noqa: BLE001 - a model that fails to load or to warm up is not served
            reason = str(exc) if isinstance(exc, RepositoryError) else f"warm-up failed: {exc}"
            log.error("could not load %s", reason)
            if serving is not None:
                # The version already served goes on; the new files are tried again when they change.
                self.slots[key] = Slot(serving.state, f"a reload failed: {reason}", serving.fingerprint, serving.since,
                                       failed=print_)
            else:
                self.slots[key] = Slot(UNAVAILABLE, self.slots[key].reason or reason, print_, time.monotonic())
            return
        await self.app.place(model)
        await self.app.announce()

    def _failed(self, name: str, reason: str) -> None:
        log.error("model %s cannot be served: %s", name, reason)
        if not any(n == name for n, _ in self.slots):
            self.notes[name] = reason



def _load_error(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text if isinstance(exc, RepositoryError) else f"ONNX Runtime could not load it: {text}"
