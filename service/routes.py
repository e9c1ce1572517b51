"""The HTTP routes: health, predict (one question or a batch), model metadata, drift and Prometheus metrics.
Each gets the app's ServiceState through ``State``; RequestGuard (service/middleware.py) has checked the
bearer token of the API routes, the content type, body size and admission before a route runs."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from service.contract import API_ERRORS, PREDICT_ERRORS, PREDICT_EXTRA
from service.errors import ApiError
from service.requests import to_question
from service.responses import drift_status, model_card, respond
from service.schemas import (
    BatchRequest,
    BatchResponse,
    DriftStatus,
    Health,
    ModelList,
    PredictRequest,
    PredictResponse,
)
from service.state import State

router = APIRouter()


@router.get("/health/live", response_model=Health, tags=["health"])
async def live() -> Health:
    return Health(status="alive")


@router.get("/health/ready", response_model=Health, tags=["health"],
            responses={503: {"model": Health, "description": "`loading`, `failed` or `draining`, with a `reason`"}})
async def ready(state: State):
    code, health = state.health()
    return JSONResponse(health.model_dump(), status_code=code)


@router.post("/predict", response_model=PredictResponse, responses=PREDICT_ERRORS,
             tags=["predict"], openapi_extra=PREDICT_EXTRA)
async def predict(body: PredictRequest, request: Request, state: State) -> PredictResponse:
    state.require_ready(request)
    q, tokens = to_question(state, body)
    (pred,) = await state.answer([q], [tokens], request)
    return respond(state, body, q, pred, request.state.request_id)


@router.post("/predict/batch", response_model=BatchResponse, responses=PREDICT_ERRORS,
             tags=["predict"], openapi_extra=PREDICT_EXTRA)
async def predict_batch(body: BatchRequest, request: Request, state: State) -> BatchResponse:
    state.require_ready(request)
    limit = state.settings.max_batch_items
    if len(body.items) > limit:
        raise ApiError(413, "too_large", f"{len(body.items)} items; the limit is {limit}", "items")
    checked = [to_question(state, item, f"items.{i}.") for i, item in enumerate(body.items)]
    questions, tokens = [q for q, _ in checked], [n for _, n in checked]
    budget = state.settings.max_request_tokens
    if sum(tokens) > budget:
        raise ApiError(413, "too_large", f"the items' prompts are {sum(tokens)} tokens in all; the limit per request "
                       f"is {budget}: send them in smaller batches", "items")
    preds = await state.answer(questions, tokens, request)
    rid = request.state.request_id
    return BatchResponse(results=[respond(state, item, q, p, f"{rid}-{i}") for i, (item, q, p) in
                                  enumerate(zip(body.items, questions, preds))])


@router.get("/v1/models", response_model=ModelList, responses=API_ERRORS, tags=["metadata"])
async def models(request: Request, state: State) -> dict:
    state.require_ready(request)
    return {"data": [model_card(state)]}


@router.get("/v1/drift", response_model=DriftStatus, responses=API_ERRORS, tags=["metadata"])
async def drift(request: Request, state: State) -> DriftStatus:
    state.require_ready(request)
    return drift_status(state)


@router.get("/metrics", tags=["metadata"], include_in_schema=False)
async def metrics(state: State) -> Response:
    if state.drift is not None:
        state.metrics.set_drift(await asyncio.to_thread(state.drift.status))
        state.metrics.set_accuracy(state.accuracy.status())
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
