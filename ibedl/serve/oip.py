"""The Open Inference Protocol (KServe v2) over REST: the container runs as a KServe custom runtime and Triton or
KServe clients (``tritonclient.http``) call it. It only translates: JSON tensors to questions and answers to
tensors (``ibedl.serve.tensors``), the engine's refusals to the protocol's ``{"error": "<type>: <message>"}`` with
the status the service gives that refusal (``ibedl.serve.errors.STATUS``) and ``Retry-After`` when it says when.
Tensors travel as JSON (the binary tensor extension is refused with a message that says so)."""

from __future__ import annotations

import functools
from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictStr

from ibedl.engine.errors import EngineError, InvalidRequest
from ibedl.serve.errors import OIP_PREFIX, engine_error_response
from ibedl.serve.state import State
from ibedl.serve.tensors import (
    Tensor,
    chosen_outputs,
    in_version,
    input_data,
    model_metadata,
    package_version,
    to_items,
    to_outputs,
)

router = APIRouter(prefix="/v2", include_in_schema=False)  # its own protocol, specified by KServe, not this OpenAPI


def dimension(value):
    """A shape's dimension: an integer, or a number that is one (1.0, as some JSON writers give it); never a string
    or a boolean (lax validation took "1" and true for 1)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or (isinstance(value, float)
                                                                         and not value.is_integer()):  # nor inf
        raise ValueError(f"a dimension is an integer, got {value!r}")
    return int(value)


class JsonTensor(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: StrictStr
    shape: list[Annotated[Any, BeforeValidator(dimension)]]
    datatype: StrictStr
    data: list[Any]


class RequestedOutput(BaseModel):
    model_config = ConfigDict(extra="allow")  # parameters (binary_data, ...) are the protocol's
    name: StrictStr


class InferRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str | None = Field(None, max_length=256)
    inputs: list[JsonTensor]
    outputs: list[RequestedOutput] | None = None


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
    """A route whose engine refusals are answered in the protocol's shape."""

    @functools.wraps(route)
    async def wrapper(*args, **kwargs):
        try:
            return await route(*args, **kwargs)
        except EngineError as e:
            return engine_error_response(e, OIP_PREFIX)

    return wrapper


def served(model: str, request: Request, state: State):
    """The ready service's adapter called ``model``, at the version the path names if it names one; EngineError
    otherwise."""
    state.require_ready(request)
    return in_version(state.engine.runtime(model), request.path_params.get("version"))


# Each route also under /versions/{version} (the protocol's; a client that pins the version metadata gives uses it).
@router.get("/models/{model}")
@router.get("/models/{model}/versions/{version}")
@answered
async def model_metadata_route(model: str, request: Request, state: State):
    return model_metadata(served(model, request, state))


@router.get("/models/{model}/ready")
@router.get("/models/{model}/versions/{version}/ready")
@answered
async def model_ready(model: str, request: Request, state: State):
    return {"name": served(model, request, state).name, "ready": True}


@router.post("/models/{model}/infer")
@router.post("/models/{model}/versions/{version}/infer")
@answered
async def infer(model: str, request: Request, state: State):
    try:
        body = InferRequest.model_validate_json(await request.body())
    except ValueError as e:  # pydantic's ValidationError: the message names what is missing or wrong
        raise InvalidRequest(f"the body is not an inference request: {e}", "inputs") from None
    runtime = served(model, request, state)
    items = to_items([Tensor(t.name, t.datatype, t.shape, input_data(t.name, t.data, t.shape)) for t in body.inputs],
                     model, state.engine.settings.max_batch_items)
    names = chosen_outputs([o.name for o in body.outputs] if body.outputs else None, runtime)  # before the model
    answers = await state.engine.ask(items, state.context(request), "inputs")
    return {"model_name": runtime.name, "model_version": runtime.ref["version"],
            **({"id": body.id} if body.id is not None else {}),
            "outputs": [vars(t) for t in to_outputs(answers, names)]}


__all__ = ["router"]
