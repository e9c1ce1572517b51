"""The HTTP routes: health, predict (one question or a batch), feedback (labels sent back with an answer's receipt)
and the realised guarantees, model metadata, drift and Prometheus metrics.
Each gets the app's ServiceState through ``State``; RequestGuard (ibedl/serve/middleware.py) has checked the
bearer token (every route but the health probes; a new route too, without being listed; the labelling credential
on the feedback routes, whose name it leaves in ``request.state.credential``), the content type, body size and
admission before a route runs."""

from __future__ import annotations

import asyncio
import contextlib

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ibedl.engine.errors import StoreUnavailable
from ibedl.engine.schemas import (
    ADAPTER_NAME_CHARS,
    BatchRequest,
    BatchResponse,
    DriftStatus,
    FeedbackBatchRequest,
    FeedbackRequest,
    FeedbackResponse,
    GuaranteesResponse,
    Health,
    ModelList,
    PredictRequest,
    PredictResponse,
)
from ibedl.serve.contract import (
    API_ERRORS,
    DRIFT_ERRORS,
    FEEDBACK_ERRORS,
    GUARANTEES_ERRORS,
    PREDICT_ERRORS,
    PREDICT_EXTRA,
)
from ibedl.serve.state import State

METRICS_STORE_WAIT_S = 1.0  # /metrics waits this long for the store's guarantees, then serves the gauges as they are

router = APIRouter()


@router.get("/health/live", response_model=Health, tags=["health"])
async def live() -> Health:
    return Health(status="alive")


@router.get("/health/ready", response_model=Health, tags=["health"],
            responses={503: {"model": Health, "description": "`loading`, `failed` or `draining`, with a `reason`"}})
async def ready(state: State):
    code, health = state.health()
    return JSONResponse(health, status_code=code)


@router.post("/predict", response_model=PredictResponse, responses=PREDICT_ERRORS,
             tags=["predict"], openapi_extra=PREDICT_EXTRA)
async def predict(body: PredictRequest, request: Request, state: State) -> PredictResponse:
    return await state.engine.ask_one(body, state.context(request))


@router.post("/predict/batch", response_model=BatchResponse, responses=PREDICT_ERRORS,
             tags=["predict"], openapi_extra=PREDICT_EXTRA)
async def predict_batch(body: BatchRequest, request: Request, state: State) -> BatchResponse:
    return BatchResponse(results=await state.engine.ask(body.items, state.context(request)))


@router.get("/v1/models", response_model=ModelList, responses=API_ERRORS, tags=["metadata"])
async def models(request: Request, state: State) -> dict:
    state.require_ready(request)
    return {"data": state.engine.cards()}


@router.get("/v1/drift", response_model=DriftStatus, responses=DRIFT_ERRORS, tags=["metadata"])
async def drift(request: Request, state: State,
                adapter: str | None = Query(None, max_length=ADAPTER_NAME_CHARS)) -> DriftStatus:
    """The drift status of one adapter (``?adapter=NAME``; default the first)."""
    state.require_ready(request)
    return state.observer.drift_status(state.engine.runtime(adapter).name)


@router.post("/v1/feedback", response_model=FeedbackResponse, responses=FEEDBACK_ERRORS, tags=["feedback"])
async def feedback(body: FeedbackRequest, request: Request, state: State) -> FeedbackResponse:
    """Record the right option of one answered question, with the receipt its answer carried (the labelling
    credential, IBEDL_LABEL_TOKEN). Any replica may receive it; a receipt keeps its first label."""
    state.require_ready(request)
    return await state.engine.record_labels([body], "", request.state.credential)


@router.post("/v1/feedback/batch", response_model=FeedbackResponse, responses=FEEDBACK_ERRORS, tags=["feedback"])
async def feedback_batch(body: FeedbackBatchRequest, request: Request, state: State) -> FeedbackResponse:
    """Record several labels at once: all or none (one bad item refuses the request and records nothing)."""
    state.require_ready(request)
    return await state.engine.record_labels(body.items, "items.", request.state.credential)


@router.get("/v1/guarantees", response_model=GuaranteesResponse, responses=GUARANTEES_ERRORS, tags=["feedback"])
async def guarantees(request: Request, state: State, adapter: str | None = None) -> GuaranteesResponse:
    """The realised guarantees of every adapter version with labels (``?adapter=NAME``: of that adapter only)."""
    state.require_ready(request)
    return await state.engine.realised(adapter)


@router.get("/metrics", tags=["metadata"], include_in_schema=False)
async def metrics(state: State) -> Response:
    observer = state.observer
    for name, monitors in list(observer.monitors.items()):
        observer.metrics.set_drift(name, await asyncio.to_thread(monitors.drift.status))
        observer.metrics.set_accuracy(name, monitors.accuracy.status())
    if state.engine.feedback_enabled and state.engine.ready:
        # sets the ibedl_guarantee_* gauges; a store that does not answer at once leaves them as they are (its call
        # sets them when it returns): a scrape never waits on another replica's lock
        with contextlib.suppress(StoreUnavailable):
            await state.engine.realised(timeout=METRICS_STORE_WAIT_S)
    return Response(generate_latest(observer.metrics.registry), media_type=CONTENT_TYPE_LATEST)
