"""The Open Inference Protocol over gRPC: KServe v2's ``inference.GRPCInferenceService`` (health, metadata and
infer), on its own port beside the HTTP one (IBEDL_GRPC_PORT, as Triton's sit side by side), behind the same bearer
token (``authorization`` metadata). It only translates: protobuf tensors to questions and answers to tensors
(``ibedl.serve.tensors``; raw contents as Triton's clients send them, or typed contents), the engine's refusals to
gRPC status codes (:data:`CODES`) with ``retry-after`` in the trailing metadata when the refusal says when. The
messages and servicer are those Triton's client package generates from the protocol's proto."""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from typing import NoReturn

import grpc
import numpy as np
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc
from tritonclient.utils import deserialize_bytes_tensor, serialize_byte_tensor

from ibedl.engine.errors import EngineError, InvalidRequest, UnknownAdapter
from ibedl.serve import logs
from ibedl.serve.auth import api_token, token_ok
from ibedl.serve.middleware import choose_request_id
from ibedl.serve.tensors import (
    Tensor,
    chosen_outputs,
    in_version,
    model_metadata,
    package_version,
    to_items,
    to_outputs,
)

log = logging.getLogger("ibedl.serve")
CODES = {  # an engine error's type -> the gRPC status it is answered with (HTTP's is ibedl.serve.errors.STATUS)
    "invalid_request": grpc.StatusCode.INVALID_ARGUMENT,
    "too_large": grpc.StatusCode.INVALID_ARGUMENT,
    "model_error": grpc.StatusCode.INTERNAL,
    "not_ready": grpc.StatusCode.UNAVAILABLE,
    "overloaded": grpc.StatusCode.UNAVAILABLE,
    "shutting_down": grpc.StatusCode.UNAVAILABLE,
    "timeout": grpc.StatusCode.DEADLINE_EXCEEDED,
    "client_closed_request": grpc.StatusCode.CANCELLED,
}
NUMPY = {"FP32": np.float32, "INT64": np.int64, "BOOL": np.bool_}
INFER_ROUTE = "/inference.GRPCInferenceService/ModelInfer"  # its route label in the request metrics and access log


def code_of(e: EngineError) -> grpc.StatusCode:
    return grpc.StatusCode.NOT_FOUND if isinstance(e, UnknownAdapter) else CODES.get(e.type, grpc.StatusCode.UNKNOWN)


def inputs_of(request: pb.ModelInferRequest) -> list[Tensor]:
    """The request's input tensors, from raw contents (4-byte length-prefixed strings) or typed contents."""
    tensors = []
    for i, t in enumerate(request.inputs):
        try:
            if i < len(request.raw_input_contents):
                data = [x.decode("utf-8") if isinstance(x, bytes) else x
                        for x in deserialize_bytes_tensor(request.raw_input_contents[i]).tolist()]
            else:
                data = [x.decode("utf-8") for x in t.contents.bytes_contents]
        except (struct.error, UnicodeDecodeError, ValueError) as e:
            raise InvalidRequest(f"input {t.name!r} is not BYTES of UTF-8 strings ({type(e).__name__})", t.name) \
                from None
        tensors.append(Tensor(t.name, t.datatype, list(t.shape), data))
    return tensors


def response_of(runtime, request: pb.ModelInferRequest, answers: list, names: list[str]):
    response = pb.ModelInferResponse(model_name=runtime.name, model_version=runtime.ref["version"], id=request.id)
    for t in to_outputs(answers, names):
        response.outputs.add(name=t.name, datatype=t.datatype, shape=t.shape)
        values = np.array(t.data, dtype=object if t.datatype == "BYTES" else NUMPY[t.datatype])
        response.raw_output_contents.append(
            serialize_byte_tensor(values).item() if t.datatype == "BYTES" else values.tobytes())
    return response


class Servicer(pb_grpc.GRPCInferenceServiceServicer):
    """The calls of the protocol this model serves; the others answer UNIMPLEMENTED (the generated default)."""

    def __init__(self, engine, settings, metrics, on_arrival=None) -> None:
        self.engine, self.settings, self.metrics = engine, settings, metrics
        self.on_arrival = on_arrival or (lambda: None)  # the service notices SIGTERM before a call is admitted

    async def _refuse(self, context, e: EngineError) -> NoReturn:
        if e.retry_after is not None:
            context.set_trailing_metadata((("retry-after", str(e.retry_after)),))
        await context.abort(code_of(e), f"{e.type}: {e.message}")

    async def _authorised(self, context) -> None:
        given = dict(context.invocation_metadata()).get("authorization", "")
        if not token_ok(api_token(self.settings), given):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "unauthorized: a valid 'authorization: Bearer <token>' metadata entry is required")

    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.engine.ready)

    async def ServerMetadata(self, request, context):
        await self._authorised(context)
        return pb.ServerMetadataResponse(name="ibedl", version=package_version())

    async def ModelReady(self, request, context):
        await self._authorised(context)
        if not self.engine.ready:  # loading, draining or failed: no model is ready, whatever its name
            return pb.ModelReadyResponse(ready=False)
        try:
            in_version(self.engine.runtime(request.name), request.version)
        except EngineError as e:
            await self._refuse(context, e)
        return pb.ModelReadyResponse(ready=True)

    async def ModelMetadata(self, request, context):
        await self._authorised(context)
        try:
            self.engine.require(self.engine.arrive())
            meta = model_metadata(in_version(self.engine.runtime(request.name), request.version))
        except EngineError as e:
            await self._refuse(context, e)
        return pb.ModelMetadataResponse(
            name=meta["name"], versions=meta["versions"], platform=meta["platform"],
            inputs=[pb.ModelMetadataResponse.TensorMetadata(**t) for t in meta["inputs"]],
            outputs=[pb.ModelMetadataResponse.TensorMetadata(**t) for t in meta["outputs"]])

    async def ModelInfer(self, request, context):
        """The answers, as /predict/batch's; counted, timed and logged as an HTTP request is (route INFER_ROUTE)."""
        await self._authorised(context)
        engine, start = self.engine, time.perf_counter()
        self.on_arrival()
        arrival = engine.arrive(choose_request_id(dict(context.invocation_metadata()).get("x-request-id")),
                                context.time_remaining())
        token, status = logs.request_id_var.set(arrival.request_id), "OK"
        self.metrics.inflight.inc()
        try:
            engine.refuse_early(arrival)
            runtime = in_version(engine.runtime(request.model_name), request.model_version)
            names = chosen_outputs([o.name for o in request.outputs] or None, runtime)  # before the model runs
            items = to_items(inputs_of(request), request.model_name, engine.settings.max_batch_items)
            answers = await engine.ask(items, arrival, "inputs")
            return response_of(runtime, request, answers, names)
        except EngineError as e:
            status = code_of(e).name
            await self._refuse(context, e)
        except asyncio.CancelledError:
            status = "CANCELLED"
            raise
        except Exception:  # a bug: logged with the request id, answered without its text
            status = "INTERNAL"
            log.exception("unhandled error on gRPC ModelInfer")
            await context.abort(grpc.StatusCode.INTERNAL, "internal_error: internal error; see the service log")
        finally:
            seconds = time.perf_counter() - start
            self.metrics.request_done(INFER_ROUTE, "grpc", status, seconds)
            logs.access("grpc", INFER_ROUTE, status, seconds, arrival.adapter, arrival.request_id)
            logs.request_id_var.reset(token)


class GrpcDoor:
    """The gRPC server of one engine, on the engine's event loop."""

    def __init__(self, engine, settings, metrics, on_arrival=None) -> None:
        self.engine, self.settings, self.metrics, self.on_arrival = engine, settings, metrics, on_arrival
        self.server: grpc.aio.Server | None = None
        self.port: int | None = None  # the bound port (IBEDL_GRPC_PORT, or the free one 0 picked)

    async def start(self) -> None:
        self.server = grpc.aio.server(options=[("grpc.max_receive_message_length", self.settings.max_body_bytes),
                                               # gRPC's default SO_REUSEPORT let a second service bind the same
                                               # port and take half the first's calls, silently
                                               ("grpc.so_reuseport", 0)])
        servicer = Servicer(self.engine, self.settings, self.metrics, self.on_arrival)
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, self.server)
        self.port = self.server.add_insecure_port(f"{self.settings.host}:{self.settings.grpc_port}")
        if self.port == 0:
            raise OSError(f"cannot bind the gRPC port {self.settings.host}:{self.settings.grpc_port}")
        await self.server.start()
        log.info("serving the Open Inference Protocol over gRPC on %s:%d", self.settings.host, self.port)

    async def stop(self, grace_s: float) -> None:
        """Stop taking calls; those in flight get ``grace_s`` seconds to end."""
        if self.server is not None:
            await asyncio.shield(self.server.stop(grace_s))
            self.server = None
