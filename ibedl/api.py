"""The Python API: score multiple-choice questions in a notebook or a batch job, without the HTTP server
(``import ibedl`` re-exports ``load``, ``Model``, ``Checked``, ``EngineError`` and ``PredictResponse`` from here).

    import ibedl
    model = ibedl.load("artifacts/default")          # or several: ibedl.load("artifacts/default", "artifacts/map")
    model.predict([{"question": "...", "options": ["...", "..."]}])   # -> list[PredictResponse]

A thin front door over the engine (``ibedl.engine.engine.Engine``), as the HTTP service (``ibedl.serve``) is: the
same checks, scheduler (threads sharing a model take fair turns, admitted by the same policy), answers, feedback and
guarantees; the limits are the engine's settings (``ibedl.engine.settings.EngineSettings``: ``IBEDL_*`` environment
variables, or keyword arguments of :func:`load`). What it refuses raises the engine's exceptions
(``ibedl.engine.errors``: ``EngineError`` and its subclasses, with ``type``, ``message``, ``field``; no HTTP
status). Nothing here imports ``ibedl.serve`` or a web framework.
"""

from __future__ import annotations

from pathlib import Path

from ibedl.core.prompt import MCQuestion
from ibedl.engine.engine import Checked, Engine
from ibedl.engine.errors import EngineError
from ibedl.engine.runtime import AdapterRuntime
from ibedl.engine.schemas import FeedbackRequest, FeedbackResponse, GuaranteesResponse, PredictRequest, PredictResponse
from ibedl.engine.settings import EngineSettings

__all__ = ["load", "Model", "Checked", "EngineError", "PredictResponse"]


class Model:
    """Served adapters on one base model, answering like ``POST /predict`` (without metrics or drift): the
    engine's Python door. ``close()`` (or ``with``) stops its scheduler's thread."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop the scheduler's thread (started by the first answer) and release the model's thread and the feedback
        store; the model answers no more after it."""
        self.engine.close()

    @property
    def runtimes(self) -> dict[str, AdapterRuntime]:
        return self.engine.runtimes

    @property
    def settings(self) -> EngineSettings:
        return self.engine.settings

    @property
    def adapters(self) -> list[str]:
        """The adapter names, the default first."""
        return list(self.engine.runtimes)

    def cards(self) -> list[dict]:
        """What ``GET /v1/models`` says of each adapter."""
        return self.engine.cards()

    def predict(self, questions: list[dict | PredictRequest | MCQuestion], adapter: str | None = None,
                batch_size: int | None = None, timeout_s: float | None = None) -> list[PredictResponse]:
        """Answers in input order.

        Args:
            questions: request bodies of ``POST /predict`` (dicts or ``PredictRequest``), or ``MCQuestion``s.
            adapter: the adapter of the questions that name none (default the first loaded).
            batch_size: questions per request to the scheduler (default ``IBEDL_MAX_BATCH_SIZE``).
            timeout_s: each request's deadline, in seconds after it is sent (default: none).

        Raises:
            ibedl.engine.errors.InvalidRequest: a question the service would refuse with 422 (``type``,
                ``message``, ``field`` as in its error body; ``field`` starts with ``items.<i>.``); its subclass
                UnknownAdapter for an adapter that is not loaded.
            ibedl.engine.errors.TooLarge: a question over a limit (the service's 413).
            ibedl.engine.errors.ModelError: non-finite model outputs (the service's 500 ``model_error``).
            ibedl.engine.errors.Overloaded, QueueFull, Timeout: the scheduler could not answer in time (the
                service's 503/504; ``retry_after`` says when to try again).
            ibedl.engine.errors.NotReady: the model was closed.
            (All are ``ibedl.EngineError``s; a dict that is not a valid request body is an InvalidRequest naming
            the field.)
        """
        return self.engine.predict(questions, adapter, batch_size, timeout_s)

    def check(self, question: dict | PredictRequest | MCQuestion, prefix: str = "",
              adapter: str | None = None) -> Checked:
        """A question checked as the service checks it (an ``EngineError`` if not)."""
        return self.engine.check(question, prefix, adapter)

    def answer(self, checked: list[Checked], batch_size: int | None = None,
               default_ids: list[str] | None = None) -> list[PredictResponse]:
        """Answers to checked questions, in order (``default_ids``: the ``id`` of an answer whose request has none;
        default its position)."""
        return self.engine.answer(checked, batch_size, default_ids)

    def record_feedback(self, labels: list[dict | FeedbackRequest]) -> FeedbackResponse:
        """Record the right options of answered questions, as ``POST /v1/feedback/batch`` does: each a
        ``{"receipt": answer.receipt, "label": "B"}``; all or none; a receipt keeps its first label.

        No labelling credential and no quota: the HTTP service asks for IBEDL_LABEL_TOKEN because its clients are
        other people, but a Python caller holds the receipt key and the store file (it could write to the store
        directly), so a credential would prove nothing here. Keep the key and the store as private as the
        labelling credential.

        Raises:
            ibedl.engine.errors.FeedbackDisabled: loaded without ``feedback_key``.
            ibedl.engine.errors.InvalidReceipt, ReceiptExpired, AdapterNotServed, InvalidRequest: a bad item
                (``field`` starts with ``items.<i>.``); nothing is recorded.
            ibedl.engine.errors.LabelConflict: a receipt recorded before with another label; nothing is recorded.
            ibedl.engine.errors.TooLarge: more than ``max_batch_items`` labels.
        """
        return self.engine.record_feedback(labels, "items.")

    def guarantees(self, adapter: str | None = None) -> GuaranteesResponse:
        """The realised guarantees from the recorded labels, as ``GET /v1/guarantees`` reports them."""
        return self.engine.guarantees(adapter)


def load(*artifacts: str | Path, **settings) -> Model:
    """Load one or several adapter directories on one shared base model (the first is the default).

    ``settings``: engine settings (:class:`ibedl.engine.settings.EngineSettings`: ``device``, ``max_tokens``,
    ``threads``, ``max_batch_size``, ``backend``, ...; ``IBEDL_*`` variables fill the rest); a name that is not one
    (an HTTP setting such as ``api_token``) raises ``pydantic.ValidationError``. Refused like the service refuses
    them: adapters of different base models, two of one name, NaN weights."""
    if not artifacts:
        raise ValueError("ibedl.load needs at least one artifact directory")
    return Model(Engine.load(EngineSettings(**{**settings, "artifacts": [Path(a) for a in artifacts]})))
