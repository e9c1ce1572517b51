"""Which runtime serves each adapter, and how that changes while the engine runs: a recalibration written in place
(the manifest's version changes, the weights do not) is served from the next request on, and ``IBEDL_BACKEND=auto``
measures the other backends in the background (ibedl.engine.backend_switch) and switches to one proven faster.
Either replaces the adapter's runtime by one assignment on the engine's event loop: a request keeps the runtime it
started with, so no pass mixes calibrations or backends."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
from functools import partial
from pathlib import Path

from ibedl.core.artifact import ArtifactError, read_manifest
from ibedl.engine.errors import StoreUnavailable
from ibedl.engine.runtime import UncalibratedBackend, recalibrated, switched

log = logging.getLogger("ibedl.engine")


class Versions:
    """The runtime replacements of one engine (``engine.versions``): reloads, the background backend measurement,
    and the watcher that notices a changed manifest."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.switcher = None  # ibedl.engine.backend_switch.BackendSwitcher while auto measures in the background
        self._stopped = False  # the watcher ends at its next step (a cancel can be lost in a store call's wait)
        self._store_down = False  # the watcher's last read of the feedback store failed (said once, not per look)
        self._swapping: asyncio.Lock | None = None  # one replacement at a time: a backend switch or a reload
        self._manifests: dict = {}  # served artifact directory -> its manifest.json's mtime when last looked at
        self._poke = asyncio.Event()  # set by poke() (SIGHUP), even while loading: looked at once serving
        self._watcher: asyncio.Task | None = None

    def remember_manifests(self) -> None:
        """Note the served manifests as they are before loading: one rewritten while the model loads is seen."""
        self._manifests = {d: _mtime(d) for d in self.engine.settings.served_artifacts()}

    def start(self, to_measure: list[str]) -> None:
        """On the engine's loop, once serving: watch the manifests, and measure ``to_measure`` in the background."""
        self._swapping = asyncio.Lock()
        self._watcher = asyncio.get_running_loop().create_task(self._watch_manifests(), name="manifest-watcher")
        if to_measure:
            from ibedl.engine.backend_switch import BackendSwitcher

            default = self.engine.default
            self.switcher = BackendSwitcher(self.engine, default.name, to_measure)
            self.switcher.start()
            log.info("auto: serving %s; building and timing %s in the background", default.ref["backend"],
                     ", ".join(to_measure))

    def poke(self) -> None:
        """Look at the manifests now (SIGHUP)."""
        self._poke.set()

    def stop(self) -> None:
        self._stopped = True
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None

    def background(self) -> dict | None:
        """What the background measurement is doing and has done (``backend.background`` of the default's card)."""
        return None if self.switcher is None else copy.deepcopy(self.switcher.status)

    # -- recalibrations ---------------------------------------------------------------------------

    async def reload_calibrations(self) -> list[str]:
        """Serve the version each served adapter's manifest.json now holds, when it is another one of the same
        weights (a recalibration: ``python -m ibedl.training.calibrate`` in place), from the next request on: a new
        runtime beside the old one (ibedl.engine.runtime.recalibrated; a pass already queued is answered under the
        old calibration), fresh monitors for it (the observers' ``serving``), and the labels of the new version
        counted apart (its promises are its own; the old version's realised guarantees stay as retired). A manifest
        that changes the weights, or cannot be read, is logged and left for a restart. Returns the adapters now on a
        new version."""
        engine, done = self.engine, []
        for directory in engine.settings.served_artifacts():
            try:
                manifest = await asyncio.to_thread(read_manifest, directory)
            except (ArtifactError, OSError, ValueError) as e:
                log.warning("reload: the manifest of %s cannot be read (%s); still serving what was loaded", directory,
                            e)
                continue
            async with self._swapping:  # a backend switch does not interleave: neither undoes the other
                rt = engine.runtimes.get(manifest.name)
                if rt is None or str(manifest.version) == rt.ref["version"]:
                    continue
                try:
                    # on the model's thread: copying the heads is torch work (ibedl.engine.engine.Engine)
                    new = await engine.batcher.between_passes(partial(recalibrated, rt, manifest, engine.settings))
                    await asyncio.to_thread(engine.notify, "serving", new)
                except (ValueError, UncalibratedBackend) as e:
                    log.warning("reload: adapter %s version %s is not served: %s", manifest.name, manifest.version, e)
                    continue
                engine.runtimes[new.name] = new
            if engine.feedback.enabled:
                with contextlib.suppress(StoreUnavailable):  # the next refresh reads the store
                    await engine.store.run(engine.feedback.bind, engine.runtimes)
            log.info("adapter %s: serving version %s (recalibrated; was %s, calibration %s)", new.name,
                     new.ref["version"], rt.ref["version"], new.calibration.key)
            done.append(new.name)
        return done

    async def _watch_manifests(self) -> None:
        """Look at the served manifests every IBEDL_RELOAD_INTERVAL_S (and at once when poked): a changed one is
        reloaded (:meth:`reload_calibrations`); then read the feedback store's new labels, so that a suspension
        another replica's labels made reaches this replica's answers though it records and is scraped nothing."""
        engine = self.engine
        poke, settings = self._poke, engine.settings
        interval = settings.reload_interval_s or None
        while not self._stopped:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(poke.wait(), interval)
            if self._stopped:
                return
            forced = poke.is_set()
            poke.clear()
            seen = {d: _mtime(d) for d in settings.served_artifacts()}
            if forced or seen != self._manifests:
                self._manifests = seen
                try:
                    await self.reload_calibrations()
                except Exception:  # a reload must never stop the watcher
                    log.exception("reload: failed; still serving what was loaded")
            if engine.feedback.enabled and engine.feedback.shared and not self._stopped:
                await self._read_feedback()

    async def _read_feedback(self) -> None:
        """Fold the labels other replicas recorded since the last read; a store that fails is said once (and again
        once it answers), then read at the next look."""
        try:
            await self.engine.store.run(self.engine.feedback.refresh)
        except Exception as e:  # neither a store that does not answer nor one that fails may stop the watcher
            if not self._store_down:
                said = log.warning if isinstance(e, StoreUnavailable) else log.exception  # a failure: its traceback
                said("feedback: reading the store's new labels failed (%s); tried again at each look, said again "
                     "when it answers", getattr(e, "message", None) or repr(e))
            self._store_down = True
            return
        if self._store_down:
            log.info("feedback: the store answers again")
        self._store_down = False

    # -- backends (IBEDL_BACKEND=auto) --------------------------------------------------------------

    def to_measure(self, predictors: list) -> list[str]:
        """The backends ``auto`` still has to build and time for the one served adapter, in the background: those
        never measured here, or every candidate once the measurement is older than IBEDL_BACKEND_MAX_AGE_S; none
        with IBEDL_BACKEND_SWITCHING off or a named backend."""
        from ibedl.core.auto_backend import age_s

        settings = self.engine.settings
        choice = predictors[0].backend_choice if len(predictors) == 1 else None
        if settings.backend != "auto" or not settings.backend_switching or choice is None:
            return []
        if choice.pending:
            return list(choice.pending)
        age = age_s(choice)
        if choice.cached and age is not None and age > settings.backend_max_age_s:
            log.info("auto: the measurement of %s is %.0f s old (IBEDL_BACKEND_MAX_AGE_S %.0f): measuring again in "
                     "the background", choice.path, age, settings.backend_max_age_s)
            return [n for n in choice.seconds if n != choice.backend]
        return []

    async def switch_backend(self, adapter: str, backend: str, trunk, reason: str, choice) -> None:
        """Serve ``adapter`` on ``backend`` (its ``trunk``) from now on: one assignment of a new runtime with the
        calibration made on it (ibedl.engine.runtime.switched), on the event loop. Requests that took the old
        runtime are answered on it, under its calibration; the next ones on the new one."""
        engine = self.engine
        async with self._swapping:
            old = engine.runtimes[adapter]
            new = await engine.batcher.between_passes(partial(
                switched, old, backend, trunk, reason, choice, engine.settings.served_artifacts()[0], engine.settings))
            engine.runtimes[adapter] = new
        engine.notify("switched", adapter, old.ref["backend"], backend)
        log.info("auto: adapter %s switched from %s (calibration %s) to %s (calibration %s): %s", adapter,
                 old.ref["backend"], old.ref["calibration"], backend, new.ref["calibration"], reason)

    async def settle_backend(self, adapter: str, choice) -> None:
        """The background measurement is done: record it on the serving predictor (the model card) and drop the
        torch model where a backend's trunk answers without it (between passes)."""
        predictor = self.engine.runtimes[adapter].predictor
        predictor.record_choice(choice)
        if predictor.trunk is not None:
            await self.engine.batcher.between_passes(predictor.release_model)


def _mtime(directory) -> float | None:
    """When an artifact's manifest.json last changed (None: unreadable)."""
    try:
        return (Path(directory) / "manifest.json").stat().st_mtime_ns
    except OSError:
        return None
