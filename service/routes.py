"""The HTTP routes: health, predict (one question or a batch), model metadata, drift and Prometheus metrics.
Each gets the app's ServiceState through ``State``; the model routes check the bearer token first."""

from __future__ import annotations

import asyncio
import secrets

from fastapi import APIRouter, Depends, Request
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


def authorised(request: Request, state: State) -> None:
    """401 unless the request carries the configured bearer token (no token configured: everyone is)."""
    token = state.settings.api_token.get_secret_value() if state.settings.api_token else None
    if not token:
        return
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(given.strip().encode(), token.encode()):
        raise ApiError(401, "unauthorized", "a valid 'Authorization: Bearer <token>' header is required",
                       headers={"WWW-Authenticate": "Bearer"})


Auth = Depends(authorised)

router = APIRouter()


@router.get("/health/live", response_model=Health, tags=["health"])
async def live() -> Health:
    return Health(status="alive")


@router.get("/health/ready", response_model=Health, tags=["health"],
            responses={503: {"model": Health, "description": "`loading`, `failed` or `draining`, with a `reason`"}})
async def ready(state: State):
    code, health = state.health()
    return JSONResponse(health.model_dump(), status_code=code)


@router.post("/predict", response_model=PredictResponse, dependencies=[Auth], responses=PREDICT_ERRORS,
             tags=["predict"], openapi_extra=PREDICT_EXTRA)
async def predict(body: PredictRequest, request: Request, state: State) -> PredictResponse:
    state.require_ready(request)
    q = to_question(state, body)
    (pred,) = await state.answer([q])
    return respond(state, body, q, pred, request.state.request_id)


@router.post("/predict/batch", response_model=BatchResponse, dependencies=[Auth], responses=PREDICT_ERRORS,
             tags=["predict"], openapi_extra=PREDICT_EXTRA)
async def predict_batch(body: BatchRequest, request: Request, state: State) -> BatchResponse:
    state.require_ready(request)
    limit = state.settings.max_batch_items
    if len(body.items) > limit:
        raise ApiError(413, "too_large", f"{len(body.items)} items; the limit is {limit}", "items")
    questions = [to_question(state, item, f"items.{i}.") for i, item in enumerate(body.items)]
    preds = await state.answer(questions)
    rid = request.state.request_id
    return BatchResponse(results=[respond(state, item, q, p, f"{rid}-{i}") for i, (item, q, p) in
                                  enumerate(zip(body.items, questions, preds))])


@router.get("/v1/models", response_model=ModelList, dependencies=[Auth], responses=API_ERRORS, tags=["metadata"])
async def models(request: Request, state: State) -> dict:
    state.require_ready(request)
    return {"data": [model_card(state)]}


@router.get("/v1/drift", response_model=DriftStatus, dependencies=[Auth], responses=API_ERRORS, tags=["metadata"])
async def drift(request: Request, state: State) -> DriftStatus:
    state.require_ready(request)
    return drift_status(state)


@router.get("/metrics", tags=["metadata"], include_in_schema=False)
async def metrics(state: State) -> Response:
    if state.drift is not None:
        state.metrics.set_drift(await asyncio.to_thread(state.drift.status))
        state.metrics.set_accuracy(state.accuracy.status())
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
