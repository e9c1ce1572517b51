"""The Python API: score multiple-choice questions in a notebook or a batch job, without the HTTP server
(``import ibedl`` re-exports ``load``, ``Model``, ``Checked``, ``EngineError`` and ``PredictResponse`` from here).

    import ibedl
    model = ibedl.load("artifacts/default")          # or several: ibedl.load("artifacts/default", "artifacts/map")
    model.predict([{"question": "...", "options": ["...", "..."]}])   # -> list[PredictResponse]

The API is the engine's second front door (the HTTP service, ``ibedl.serve``, is the first): the records are the
service's (``ibedl.engine.schemas.PredictResponse``), checked and built by the same engine functions
(``ibedl.engine.requests.to_question``, ``ibedl.engine.responses.build_answer``); the limits are the engine's
settings (``ibedl.engine.settings.EngineSettings``: ``IBEDL_*`` environment variables, or keyword arguments of
:func:`load`). What it refuses raises the engine's exceptions (``ibedl.engine.errors``: ``EngineError`` and its
subclasses, with ``type``, ``message``, ``field``; no HTTP status). Nothing here imports ``ibedl.serve`` or a web
framework.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

from ibedl.core.prompt import MCQuestion
from ibedl.engine.errors import EngineError, ModelError
from ibedl.engine.feedback import Feedback, served_versions
from ibedl.engine.requests import to_question
from ibedl.engine.responses import build_answer, model_card
from ibedl.engine.runtime import AdapterRuntime, find_adapter, finite_prediction, load_predictors, make_runtimes
from ibedl.engine.schemas import FeedbackRequest, FeedbackResponse, GuaranteesResponse, PredictRequest, PredictResponse
from ibedl.engine.settings import EngineSettings

__all__ = ["load", "Model", "Checked", "EngineError", "PredictResponse"]


@dataclass
class Checked:
    """A question the service would accept: its adapter, request body and parsed question."""

    runtime: AdapterRuntime
    request: PredictRequest
    question: MCQuestion


class Model:
    """Served adapters on one base model, answering like ``POST /predict`` (without metrics or drift)."""

    def __init__(self, runtimes: dict[str, AdapterRuntime], settings: EngineSettings, clock=None) -> None:
        self.runtimes = runtimes
        self.settings = settings
        # receipts out, labels in: on when settings carry a feedback_key (the service's, to share its store)
        self.feedback = Feedback(settings) if clock is None else Feedback(settings, clock)
        self.feedback.bind(runtimes)
        # One forward pass at a time: adapters share one base (PEFT switches the active adapter per pass) and
        # one tokenizer, so threads that share a Model take turns.
        self._lock = threading.Lock()

    @property
    def adapters(self) -> list[str]:
        """The adapter names, the default first."""
        return list(self.runtimes)

    def cards(self) -> list[dict]:
        """What ``GET /v1/models`` says of each adapter."""
        return [model_card(rt, self.settings) for rt in self.runtimes.values()]

    def predict(self, questions: list[dict | PredictRequest | MCQuestion], adapter: str | None = None,
                batch_size: int | None = None) -> list[PredictResponse]:
        """Answers in input order.

        Args:
            questions: request bodies of ``POST /predict`` (dicts or ``PredictRequest``), or ``MCQuestion``s.
            adapter: the adapter of the questions that name none (default the first loaded).
            batch_size: questions per forward pass (default ``IBEDL_MAX_BATCH_SIZE``).

        Raises:
            ibedl.engine.errors.InvalidRequest: a question the service would refuse with 422 (``type``,
                ``message``, ``field`` as in its error body; ``field`` starts with ``items.<i>.``); its subclass
                UnknownAdapter for an adapter that is not loaded.
            ibedl.engine.errors.TooLarge: a question over a limit (the service's 413).
            ibedl.engine.errors.ModelError: non-finite model outputs (the service's 500 ``model_error``).
            (All three are ``ibedl.EngineError``s.)
            pydantic.ValidationError: a dict that is not a valid request body.
        """
        return self.answer([self.check(q, f"items.{i}.", adapter) for i, q in enumerate(questions)], batch_size)

    def check(self, question: dict | PredictRequest | MCQuestion, prefix: str = "",
              adapter: str | None = None) -> Checked:
        """A question checked as the service checks it (``EngineError`` or ``pydantic.ValidationError`` if not)."""
        req = self._request(question)
        runtime = self._runtime(req.adapter or adapter, prefix + "adapter")
        q, _ = to_question(runtime, self.settings, req, prefix)
        return Checked(runtime, req, q)

    def answer(self, checked: list[Checked], batch_size: int | None = None,
               default_ids: list[str] | None = None) -> list[PredictResponse]:
        """Answers to checked questions, in order; each forward pass holds one adapter's questions.
        ``default_ids``: the ``id`` of an answer whose request has none (default its position)."""
        size = batch_size or self.settings.max_batch_size
        if size < 1:
            raise ValueError(f"batch_size must be >= 1, got {size}")
        ids = default_ids or [str(i) for i in range(len(checked))]
        answers: list[PredictResponse | None] = [None] * len(checked)
        for runtime in self.runtimes.values():
            mine = [i for i, c in enumerate(checked) if c.runtime is runtime]
            for start in range(0, len(mine), size):
                chunk = mine[start:start + size]
                with self._lock:
                    preds = runtime.predict([checked[i].question for i in chunk])
                broken = [i for i, p in zip(chunk, preds, strict=True) if not finite_prediction(p)]
                if broken:
                    raise ModelError(f"the model produced non-finite numbers for items {broken}")
                for i, pred in zip(chunk, preds, strict=True):
                    answers[i] = build_answer(runtime, checked[i].request, checked[i].question, pred, ids[i],
                                              self.feedback)
        return answers  # type: ignore[return-value]

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
            pydantic.ValidationError: a dict that is not a valid item.
        """
        items = [x if isinstance(x, FeedbackRequest) else FeedbackRequest.model_validate(x) for x in labels]
        results = self.feedback.record(served_versions(self.runtimes), [(x.receipt, x.label) for x in items], "items.")
        recorded = sum(r["status"] == "recorded" for r in results)
        return FeedbackResponse(recorded=recorded, duplicates=len(results) - recorded, results=results)

    def guarantees(self, adapter: str | None = None) -> GuaranteesResponse:
        """The realised guarantees from the recorded labels, as ``GET /v1/guarantees`` reports them."""
        if adapter is not None:
            adapter = self._runtime(adapter, "adapter").name
        return GuaranteesResponse(alpha=self.feedback.alpha, shared_store=self.feedback.shared,
                                  guarantees=self.feedback.guarantees(served_versions(self.runtimes), adapter))

    def _request(self, q) -> PredictRequest:
        if isinstance(q, PredictRequest):
            return q
        if isinstance(q, MCQuestion):
            return PredictRequest(question=q.question, options=list(q.options), context=q.context, id=q.id)
        return PredictRequest.model_validate(q)

    def _runtime(self, name: str | None, field: str) -> AdapterRuntime:
        return find_adapter(self.runtimes, name, field, where="loaded")


def load(*artifacts: str | Path, **settings) -> Model:
    """Load one or several adapter directories on one shared base model (the first is the default).

    ``settings``: engine settings (:class:`ibedl.engine.settings.EngineSettings`: ``device``, ``max_tokens``,
    ``threads``, ``max_batch_size``, ``backend``, ...; ``IBEDL_*`` variables fill the rest); a name that is not one
    (an HTTP setting such as ``api_token``) raises ``pydantic.ValidationError``. Refused like the service refuses
    them: adapters of different base models, two of one name, NaN weights."""
    if not artifacts:
        raise ValueError("ibedl.load needs at least one artifact directory")
    config = EngineSettings(**{**settings, "artifacts": [Path(a) for a in artifacts]})
    return Model(make_runtimes(load_predictors(config), config), config)
