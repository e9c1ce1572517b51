"""``IBEDL_BACKEND=auto`` in a serving engine: ready at once on what needs no build, faster once proven.

The service loads on the cached measurement's winner, else torch (ibedl.core.auto_backend.start_choice). Then a
:class:`BackendSwitcher` builds each candidate still to measure (its IR exported by a child process at the lowest
CPU priority: ``python -m ibedl.core.measure_backends --build NAME``; the parent only compiles the cached IR), times it
against the backend serving now, the two alternated on the model's thread between passes (a timing call delays
answers by one batch's time at most), and switches to it when it is faster (ibedl.core.auto_backend.tournament). A
switch replaces the adapter's runtime by one on the new trunk with the calibration made on it
(ibedl.engine.runtime.switched): a request keeps the runtime it started with, so no pass mixes backends and every
answer carries the backend and calibration that computed it. A build that fails or crashes leaves the service where
it was; the reason is logged and shown in ``GET /v1/models`` (``backend.background``). A measurement older than
``IBEDL_BACKEND_MAX_AGE_S`` is taken again the same way.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import signal
import subprocess
import sys
import threading
from pathlib import Path

from ibedl.core import auto_backend, backends
from ibedl.core.memory_limit import expendable, killed_reason

log = logging.getLogger("ibedl.engine.backend_switch")

BUILD_TIMEOUT_S = 3600  # NNCF quantises the int8 trunk in minutes at the lowest priority on a busy machine


class BuildFailed(RuntimeError):
    """The child process that exports an IR failed, crashed or ran out of time."""


def build_in_child(name: str, artifact: Path, base_model: str | None, threads: int | None) -> None:
    """Export the IR of backend ``name`` into the cache in a child process at the lowest CPU priority (``nice 19``)
    and the first pick of the out-of-memory killer (ibedl.core.memory_limit.expendable): its memory peak ends with
    it, a build that does not fit the container is killed instead of the service, and it never holds the service's
    GIL. BuildFailed with its last error line (and, when it was killed, the likely reason and the way around)."""
    cmd = [sys.executable, "-m", "ibedl.core.measure_backends", "--artifact", str(artifact), "--build", name,
           *(["--base-model", base_model] if base_model else []), *(["--threads", str(threads)] if threads else [])]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S,
                              preexec_fn=expendable)
    except subprocess.TimeoutExpired as e:
        raise BuildFailed(f"exporting {name} took over {BUILD_TIMEOUT_S} s") from e
    if done.returncode != 0:
        code = done.returncode
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with {code}"
        why = killed_reason(signal.Signals(-code).name, f"export the {name} IR") if code < 0 else ""
        tail = "" if code < 0 else (done.stderr.strip().splitlines() or [""])[-1]  # a killed one left no error
        raise BuildFailed(f"the process exporting {name} {how}{why}: {tail}".rstrip(": "))


class BackendSwitcher:
    """The background measurement of one adapter's backends (``auto``), switching the service as it proves one
    faster. ``build(name)`` returns a compiled trunk (default: the cached IR, exported first by
    :func:`build_in_child` when missing); ``timer(run) -> seconds`` times one call (default
    ibedl.core.auto_backend.time_call), always on the model's thread between passes."""

    def __init__(self, engine, adapter: str, names: list[str], build=None, timer=None,
                 rounds: int = auto_backend.TIMING_ROUNDS) -> None:
        if rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {rounds}")
        self.engine, self.adapter, self.names, self.rounds = engine, adapter, list(names), rounds
        settings, runtime = engine.settings, engine.runtimes[adapter]
        self.artifact = Path(settings.served_artifacts()[0])
        self.choice = runtime.predictor.backend_choice
        # the model's thread owns the predictor's tokenizer: this thread encodes with its own copy
        self.shadow = copy.copy(runtime.predictor)
        self.shadow.tokenizer = copy.deepcopy(runtime.predictor.tokenizer)
        self._build = build or self._build_cached_or_in_child
        self.timer = timer or auto_backend.time_call
        self.status: dict = {"state": "waiting", "candidates": list(names), "failed": {}, "switches": [],
                             "seconds": {}}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.done = threading.Event()

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._work, name="ibedl-backend-switch", daemon=True)
        self._thread.start()

    # -- on the switcher's thread -----------------------------------------------------------------

    def _on_loop(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def _build_cached_or_in_child(self, name: str):
        settings = self.engine.settings
        try:
            return backends.build_one(name, self.shadow, self.artifact, self.choice.base_sha256, export=False)
        except FileNotFoundError:
            log.info("auto: building %s in a child process at low priority", name)
            build_in_child(name, self.artifact, settings.base_model, settings.threads)
        self.status["state"] = f"compiling {name}"
        return backends.build_one(name, self.shadow, self.artifact, self.choice.base_sha256, export=False)

    def _build_noted(self, name: str):
        self.status["state"] = f"building {name}"
        try:
            trunk = self._build(name)
            for step in backends.preparation(trunk):  # e.g. CUDA graphs: captured on the model's thread, which
                self.status["state"] = f"preparing {name}"  # replays them, one shape between two passes
                self._on_loop(self.engine.batcher.between_passes(step))
        except auto_backend.BUILD_ERRORS as e:
            self.status["failed"][name] = f"{type(e).__name__}: {e}"
            log.warning("auto: building %s failed (%s: %s); still serving %s", name, type(e).__name__, e,
                        self.engine.runtimes[self.adapter].ref["backend"])
            raise
        self.status["state"] = f"timing {name}"
        return trunk

    def _time(self, run) -> float:
        return self._on_loop(self.engine.batcher.between_passes(lambda: self.timer(run)))

    def _switch(self, name: str, trunk) -> None:
        before = self.engine.runtimes[self.adapter].ref["backend"]
        self._on_loop(self.engine.versions.switch_backend(self.adapter, name, trunk, "proven faster in the background",
                                                self.choice))
        self.status["switches"].append({"from": before, "to": name})
        if before == backends.REFERENCE:  # never back to a champion it beat: the torch weights can go
            self.shadow.drop_model()  # the shadow only encodes; it keeps the torch calibration key
            self._on_loop(self.engine.batcher.between_passes(self.engine.runtimes[self.adapter].predictor.release_model))

    def _work(self) -> None:
        try:
            runtime = self.engine.runtimes[self.adapter]
            serving = (runtime.ref["backend"], runtime.predictor.trunk)
            del runtime  # once switched from, nothing here holds the start's runtime (its torch model among it)
            batch = self.shadow.encode(auto_backend.timing_questions())
            best, _, seconds, failed = auto_backend.tournament(
                self.names, self._build_noted, auto_backend.runner(self.shadow, batch), serving, self._time,
                self.rounds, self._switch)
            del serving  # the start's trunk: freed before the model's drop below collects the heap, not after "done"
            names, skipped = auto_backend.candidates(self.shadow, self.artifact, backends.unavailable)
            self.choice = auto_backend.record(self.shadow, self.artifact, self.choice.base_sha256, names, seconds,
                                              {**skipped, **failed}, best)
            self.status.update(state="recording the measurement", seconds=seconds)
            self.shadow.drop_model()  # the torch model is freed once the runtime drops it too
            self._on_loop(self.engine.versions.settle_backend(self.adapter, self.choice))
            # "done" only once the card shows the measurement: a client that waits for it reads the timings
            self.status["state"] = "done"
            log.info("auto: measured in the background: serving %s (%s)", best, self.choice.reason)
        except Exception as e:  # the service stays where it was
            self.status.update(state="failed", reason=f"{type(e).__name__}: {e}")
            log.exception("auto: the background measurement failed; the service stays on %s",
                          self.engine.runtimes[self.adapter].ref["backend"])
        finally:
            self.done.set()


__all__ = ["BackendSwitcher", "BuildFailed", "build_in_child", "BUILD_TIMEOUT_S"]
