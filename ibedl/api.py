"""The Python API: score multiple-choice questions in a notebook or a batch job, without the HTTP server
(``import ibedl`` re-exports ``load``, ``Model``, ``Checked``, ``ApiError`` and ``PredictResponse`` from here).

    import ibedl
    model = ibedl.load("artifacts/default")          # or several: ibedl.load("artifacts/default", "artifacts/map")
    model.predict([{"question": "...", "options": ["...", "..."]}])   # -> list[PredictResponse]

The records are the service's (``ibedl.engine.schemas.PredictResponse``), checked and built by the same functions
(``ibedl.engine.requests.to_question``, ``ibedl.engine.responses.build_answer``); the limits are the service settings'
(``IBEDL_*`` environment variables, or keyword arguments of :func:`load`). FastAPI is not imported.
"""

from __future__ import annotations

import threading

from dataclasses import dataclass
from pathlib import Path

from ibedl.core.prompt import MCQuestion
from ibedl.serve.errors import ApiError
from ibedl.engine.requests import to_question
from ibedl.engine.responses import build_answer, model_card
from ibedl.engine.runtime import AdapterRuntime, finite_prediction, load_predictors, make_runtimes
from ibedl.engine.schemas import PredictRequest, PredictResponse
from ibedl.serve.settings import Settings

__all__ = ["load", "Model", "Checked", "ApiError", "PredictResponse"]


@dataclass
class Checked:
    """A question the service would accept: its adapter, request body and parsed question."""

    runtime: AdapterRuntime
    request: PredictRequest
    question: MCQuestion


class Model:
    """Served adapters on one base model, answering like ``POST /predict`` (without metrics or drift)."""

    def __init__(self, runtimes: dict[str, AdapterRuntime], settings: Settings) -> None:
        self.runtimes = runtimes
        self.settings = settings
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
            ApiError: a question the service would refuse (``status``, ``type``, ``field`` as in its error body;
                ``field`` starts with ``items.<i>.``), or non-finite model outputs.
            pydantic.ValidationError: a dict that is not a valid request body.
        """
        return self.answer([self.check(q, f"items.{i}.", adapter) for i, q in enumerate(questions)], batch_size)

    def check(self, question: dict | PredictRequest | MCQuestion, prefix: str = "",
              adapter: str | None = None) -> Checked:
        """A question checked as the service checks it (``ApiError`` or ``pydantic.ValidationError`` if not)."""
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
                broken = [i for i, p in zip(chunk, preds) if not finite_prediction(p)]
                if broken:
                    raise ApiError(503, "model_error", f"the model produced non-finite numbers for items {broken}")
                for i, pred in zip(chunk, preds):
                    answers[i] = build_answer(runtime, checked[i].request, checked[i].question, pred, ids[i])
        return answers  # type: ignore[return-value]

    def _request(self, q) -> PredictRequest:
        if isinstance(q, PredictRequest):
            return q
        if isinstance(q, MCQuestion):
            return PredictRequest(question=q.question, options=list(q.options), context=q.context, id=q.id)
        return PredictRequest.model_validate(q)

    def _runtime(self, name: str | None, field: str) -> AdapterRuntime:
        if name is None:
            return next(iter(self.runtimes.values()))
        if name not in self.runtimes:
            raise ApiError(422, "invalid_request", f"no adapter {name!r} is loaded; choose one of "
                           f"{list(self.runtimes)}", field)
        return self.runtimes[name]


def load(*artifacts: str | Path, **settings) -> Model:
    """Load one or several adapter directories on one shared base model (the first is the default).

    ``settings``: service settings (``device``, ``max_tokens``, ``threads``, ...; ``IBEDL_*`` variables fill the
    rest). Refused like the service refuses them: adapters of different base models, two of one name, NaN
    weights."""
    if not artifacts:
        raise ValueError("ibedl.load needs at least one artifact directory")
    config = Settings(**{**settings, "artifacts": [Path(a) for a in artifacts]})
    return Model(make_runtimes(load_predictors(config), config), config)
