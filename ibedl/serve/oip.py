"""The Open Inference Protocol (KServe v2, REST) as a third front door: the container runs as a KServe custom
runtime and Triton or KServe clients (``tritonclient.http``) call it. A thin mapping over the same answers as
``POST /predict/batch`` (:func:`ibedl.serve.routes.answer_items`: scheduling, admission, calibration, guarantees):

- inputs, all ``BYTES``: ``question`` [B], ``options`` [B, C] (one option count per request), ``context`` [B]
  (optional; an empty string for none);
- outputs: ``answer`` (BYTES [B], the letter), ``answer_index`` (INT64 [B]), ``probabilities`` and
  ``belief_masses`` (FP32 [B, C]), ``uncertainty_mass`` and ``confidence`` (FP32 [B]), ``abstained`` (BOOL [B]),
  ``abstain_reason`` and ``prediction_set`` (BYTES [B]; the set's letters joined, ``""`` for none), ``guarantee_holds``
  (BOOL [B]) and ``receipt`` (BYTES [B]); a request's ``outputs`` picks some of them.

Tensors travel as JSON (the binary tensor extension is refused with a message that says so). A refusal is
``{"error": "<type>: <message>"}`` with the status the service gives that refusal (ibedl.serve.errors.STATUS).
"""

from __future__ import annotations

import functools
import math
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from ibedl.engine.errors import EngineError, InvalidRequest
from ibedl.engine.schemas import PredictRequest
from ibedl.serve.errors import status_of
from ibedl.serve.routes import answer_items
from ibedl.serve.state import State

router = APIRouter(prefix="/v2", include_in_schema=False)  # its own protocol, specified by KServe, not this OpenAPI
INPUTS = {"question": [-1], "options": [-1, -1], "context": [-1]}
OUTPUTS = {  # name -> (datatype, shape after the batch, value of one answer)
    "answer": ("BYTES", [], lambda a: a.prediction.letter),
    "answer_index": ("INT64", [], lambda a: a.prediction.index),
    "probabilities": ("FP32", [-1], lambda a: list(a.probabilities.values())),
    "belief_masses": ("FP32", [-1], lambda a: list((a.belief_masses or {}).values()) or [math.nan] * len(
        a.probabilities)),
    "uncertainty_mass": ("FP32", [], lambda a: math.nan if a.uncertainty_mass is None else a.uncertainty_mass),
    "confidence": ("FP32", [], lambda a: a.confidence),
    "abstained": ("BOOL", [], lambda a: a.abstained),
    "abstain_reason": ("BYTES", [], lambda a: a.abstain_reason or ""),
    "prediction_set": ("BYTES", [], lambda a: "".join(a.prediction_set or [])),
    "guarantee_holds": ("BOOL", [], lambda a: bool(a.guarantees and a.guarantees.holds)),
    "receipt": ("BYTES", [], lambda a: a.receipt or ""),
}


class Tensor(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    shape: list[int]
    datatype: str
    data: list[Any]


class InferRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str | None = Field(None, max_length=256)
    inputs: list[Tensor]
    outputs: list[dict] | None = None


def refusal(e: EngineError) -> JSONResponse:
    return JSONResponse({"error": f"{e.type}: {e.message}"}, status_code=status_of(e))


def flat(values: list) -> list:
    return [x for v in values for x in (flat(v) if isinstance(v, list) else [v])]


def strings(t: Tensor, rows: int | None) -> list[list[str]]:
    """A BYTES tensor's strings as ``rows`` rows (row-major); InvalidRequest naming the input otherwise."""
    data = flat(t.data)
    if t.datatype != "BYTES" or any(not isinstance(x, str) for x in data):
        raise InvalidRequest(f"input {t.name!r} must be BYTES given as JSON strings, got {t.datatype}", t.name)
    if len(t.shape) != len(INPUTS[t.name]) or math.prod(t.shape) != len(data) or (rows and t.shape[0] != rows):
        raise InvalidRequest(f"input {t.name!r} has shape {t.shape} and {len(data)} values; it must be "
                             f"{'[B]' if len(INPUTS[t.name]) == 1 else '[B, C]'} with B = {rows or 'the batch'}",
                             t.name)
    width = t.shape[1] if len(t.shape) == 2 else 1
    return [data[i * width:(i + 1) * width] for i in range(t.shape[0])]


def to_items(body: InferRequest, model: str) -> list[PredictRequest]:
    tensors = {t.name: t for t in body.inputs}
    unknown = sorted(set(tensors) - set(INPUTS))
    if unknown or "question" not in tensors or "options" not in tensors:
        raise InvalidRequest(f"inputs are question [B] and options [B, C] (BYTES), context [B] optional; got "
                             f"{sorted(tensors)}", "inputs")
    questions = [row[0] for row in strings(tensors["question"], None)]
    options = strings(tensors["options"], len(questions))
    contexts = [row[0] or None for row in strings(tensors["context"], len(questions))] if "context" in tensors \
        else [None] * len(questions)
    try:
        return [PredictRequest(question=q, options=o, context=c, adapter=model)
                for q, o, c in zip(questions, options, contexts, strict=True)]
    except ValueError as e:  # pydantic's check of one item: the message names the field
        raise InvalidRequest(f"an item is not a question: {e}", "inputs") from None


def to_outputs(answers: list, requested: list[dict] | None) -> list[dict]:
    names = [o.get("name") for o in requested] if requested else list(OUTPUTS)
    unknown = sorted(set(names) - set(OUTPUTS), key=str)
    if unknown:
        raise InvalidRequest(f"unknown outputs {unknown}; this model has {list(OUTPUTS)}", "outputs")
    out = []
    for name in names:
        datatype, tail, value = OUTPUTS[name]
        rows = [value(a) for a in answers]
        shape = [len(answers), *([len(rows[0])] if tail and rows else [])]
        out.append({"name": name, "datatype": datatype, "shape": shape, "data": flat(rows)})
    return out


def package_version() -> str:
    try:
        return version("ibedl")
    except PackageNotFoundError:
        return "unknown"


@router.get("/health/live")
async def live() -> dict:
    return {"live": True}


@router.get("/health/ready")
async def ready(state: State):
    code, _ = state.health()
    return JSONResponse({"ready": code == 200}, status_code=200 if code == 200 else 400)


@router.get("")
async def server_metadata() -> dict:
    return {"name": "ibedl", "version": package_version(), "extensions": []}


def answered(route):
    """A route whose engine refusals are answered in the protocol's shape (:func:`refusal`)."""

    @functools.wraps(route)
    async def wrapper(*args, **kwargs):
        try:
            return await route(*args, **kwargs)
        except EngineError as e:
            return refusal(e)

    return wrapper


def served(model: str, request: Request, state: State):
    """The ready service's adapter called ``model``; EngineError otherwise."""
    state.require_ready(request)
    return state.runtime(model)


@router.get("/models/{model}")
@answered
async def model_metadata(model: str, request: Request, state: State):
    runtime = served(model, request, state)
    return {"name": runtime.name, "versions": [runtime.ref["version"]], "platform": "ibedl",
            "inputs": [{"name": n, "datatype": "BYTES", "shape": s} for n, s in INPUTS.items()],
            "outputs": [{"name": n, "datatype": d, "shape": [-1, *([-1] if t else [])]}
                        for n, (d, t, _) in OUTPUTS.items()]}


@router.get("/models/{model}/ready")
@answered
async def model_ready(model: str, request: Request, state: State):
    return {"name": served(model, request, state).name, "ready": True}


@router.post("/models/{model}/infer")
@answered
async def infer(model: str, request: Request, state: State):
    try:
        body = InferRequest.model_validate_json(await request.body())
    except ValueError as e:  # pydantic's ValidationError: the message names what is missing or wrong
        raise InvalidRequest(f"the body is not an inference request: {e}", "inputs") from None
    answers = await answer_items(state, to_items(body, model), request, "inputs")
    runtime, outputs = state.runtime(model), to_outputs(answers, body.outputs)
    return {"model_name": runtime.name, "model_version": runtime.ref["version"],
            **({"id": body.id} if body.id is not None else {}), "outputs": outputs}


__all__ = ["router", "INPUTS", "OUTPUTS"]
