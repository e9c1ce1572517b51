"""Helpers of the engine's tests."""

import threading
import time
from pathlib import Path

from ibedl.engine.engine import Engine
from ibedl.engine.settings import EngineSettings


def engine_with(artifact: Path, delay: float = 0.0, gate: threading.Event | None = None,
                **settings) -> tuple[Engine, list[list[str]]]:
    """An engine on ``artifact`` whose model records each pass's questions, sleeps ``delay`` seconds per pass and,
    with a ``gate``, holds its first pass until the gate opens."""
    engine = Engine.load(EngineSettings(artifact=artifact, max_tokens=96, **settings))
    passes: list[list[str]] = []
    predictor = engine.default.predictor
    original = predictor.predict

    def predict(questions, truncate_context=True):
        passes.append([q.question for q in questions])
        if gate is not None and len(passes) == 1:
            assert gate.wait(30), "the test never opened the gate"
        time.sleep(delay)
        return original(questions, truncate_context)

    predictor.predict = predict
    return engine, passes

