"""What the engine tells whoever watches it (the service's metrics, drift monitors and accuracy estimates): an
:class:`Observer` is attached with ``Engine(observers=[...])`` or ``engine.observers.append``; each method is called
on the engine's event loop or a worker thread of it, and must be quick. The engine keeps none of what they record."""

from __future__ import annotations


class Observer:
    """Every event the engine reports; a subclass overrides those it records (the defaults do nothing)."""

    def serving(self, runtime) -> None:
        """``runtime`` (ibedl.engine.runtime.AdapterRuntime) is served from now on: once loaded, and after a
        recalibration is reloaded (a backend switch keeps the adapter's monitors: :meth:`switched`). Called on a
        worker thread (it may build monitors)."""

    def estimated(self, per_token_s: float) -> None:
        """The first estimate of model seconds per prompt token, timed at load (each pass refines it: :meth:`batch`)."""

    def readiness(self, ready: bool) -> None:
        """The engine started (True) or stopped (False) accepting requests."""

    def answered(self, runtime, question, prediction, answer) -> None:
        """An answer the engine gave: its runtime, ``MCQuestion``, ``Prediction`` and ``PredictResponse``."""

    def refused(self, reason: str, count: int) -> None:
        """``count`` questions refused or dropped before an answer, under ``reason`` (an EngineError's)."""

    def model_error(self, count: int, request_id: str) -> None:
        """The model gave non-finite numbers for ``count`` questions of a request; they were not answered."""

    def batch(self, size: int, seconds: float, per_token_s: float, overrun: float) -> None:
        """A forward pass of ``size`` questions took ``seconds``; the scheduler's estimates after it."""

    def depth(self, questions: int) -> None:
        """Questions waiting for the model now."""

    def switched(self, adapter: str, old: str, new: str) -> None:
        """``adapter`` moved from backend ``old`` to ``new``. Called on the engine's event loop."""

    def labels(self, results: list) -> None:
        """Labels recorded or refused as duplicates (``FeedbackResult`` rows with ``adapter`` and ``status``)."""

    def conflicts(self, adapters: tuple[str, ...]) -> None:
        """Labels refused because they contradict their receipt's first label (one adapter name per label)."""

    def guarantees(self, rows: list[dict]) -> None:
        """The realised guarantees just read from the feedback store."""
