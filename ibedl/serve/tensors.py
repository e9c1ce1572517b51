"""The Open Inference Protocol's tensors of this model, whatever carries them (REST's JSON in ``ibedl.serve.oip``,
gRPC's protobuf in ``ibedl.serve.grpc_door``):

- inputs, all ``BYTES``: ``question`` [B], ``options`` [B, C] (one option count per request), ``context`` [B]
  (optional; an empty string for none);
- outputs: ``answer`` (BYTES [B], the letter), ``answer_index`` (INT64 [B]), ``probabilities`` and
  ``belief_masses`` (FP32 [B, C]), ``uncertainty_mass`` and ``confidence`` (FP32 [B]), ``abstained`` (BOOL [B]),
  ``abstain_reason`` and ``prediction_set`` (BYTES [B]; the set's letters joined, ``""`` for none), ``guarantee_holds``
  (BOOL [B]) and ``receipt`` (BYTES [B]); a request's ``outputs`` picks some of them. An adapter without a Dirichlet
  (a softmax head: MAP and its kin) has no ``belief_masses`` nor ``uncertainty_mass``: its metadata does not list
  them, its answers leave them out, and asking for them is refused.

Each dimension is at least 1; ``data`` is given flat or nested as ``shape`` (row-major); an input is given once.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

from ibedl.engine.errors import InvalidRequest, TooLarge, UnknownAdapter, too_many_items
from ibedl.engine.schemas import PredictRequest

INPUTS = {"question": [-1], "options": [-1, -1], "context": [-1]}
OUTPUTS = {  # name -> (datatype, shape after the batch, value of one answer)
    "answer": ("BYTES", [], lambda a: a.prediction.letter),
    "answer_index": ("INT64", [], lambda a: a.prediction.index),
    "probabilities": ("FP32", [-1], lambda a: list(a.probabilities.values())),
    "belief_masses": ("FP32", [-1], lambda a: list(a.belief_masses.values())),
    "uncertainty_mass": ("FP32", [], lambda a: a.uncertainty_mass),
    "confidence": ("FP32", [], lambda a: a.confidence),
    "abstained": ("BOOL", [], lambda a: a.abstained),
    "abstain_reason": ("BYTES", [], lambda a: a.abstain_reason or ""),
    "prediction_set": ("BYTES", [], lambda a: "".join(a.prediction_set or [])),
    "guarantee_holds": ("BOOL", [], lambda a: bool(a.guarantees and a.guarantees.holds)),
    "receipt": ("BYTES", [], lambda a: a.receipt or ""),
}
DIRICHLET = ("belief_masses", "uncertainty_mass")  # the outputs only an adapter answering a Dirichlet has


@dataclass
class Tensor:
    """One tensor of a request or an answer: its values flat, row-major."""

    name: str
    datatype: str
    shape: list[int]
    data: list


def flat(values: list) -> list:
    return [x for v in values for x in (flat(v) if isinstance(v, list) else [v])]


def input_data(name: str, data: list, shape: list[int]) -> list:
    """An input's values flat, from ``data`` given flat or nested exactly as ``shape``; InvalidRequest otherwise."""
    if not any(isinstance(x, list) for x in data):
        return data

    def rows(value, dims: list[int]) -> list:
        if not dims:
            if isinstance(value, list):
                raise InvalidRequest(f"input {name!r} is nested deeper than its shape {shape}", name)
            return [value]
        if not isinstance(value, list) or len(value) != dims[0]:
            raise InvalidRequest(f"input {name!r}'s nested data does not have its shape {shape}", name)
        return [x for v in value for x in rows(v, dims[1:])]

    return rows(data, shape)


def strings(t: Tensor, rows: int | None) -> list[list[str]]:
    """A BYTES tensor's strings as ``rows`` rows (row-major); InvalidRequest naming the input otherwise."""
    if any(d < 1 for d in t.shape):
        raise InvalidRequest(f"input {t.name!r} has shape {t.shape}: every dimension is at least 1", t.name)
    if t.datatype != "BYTES" or any(not isinstance(x, str) for x in t.data):
        raise InvalidRequest(f"input {t.name!r} must be BYTES given as strings, got {t.datatype}", t.name)
    if len(t.shape) != len(INPUTS[t.name]) or math.prod(t.shape) != len(t.data) or (rows and t.shape[0] != rows):
        raise InvalidRequest(f"input {t.name!r} has shape {t.shape} and {len(t.data)} values; it must be "
                             f"{'[B]' if len(INPUTS[t.name]) == 1 else '[B, C]'} with B = {rows or 'the batch'}",
                             t.name)
    width = t.shape[1] if len(t.shape) == 2 else 1
    return [t.data[i * width:(i + 1) * width] for i in range(t.shape[0])]


def to_items(inputs: list[Tensor], model: str, limit: int | None = None) -> list[PredictRequest]:
    """The questions of a request's input tensors, for adapter ``model``; TooLarge past ``limit`` rows
    (IBEDL_MAX_BATCH_ITEMS), before any row is read."""
    tensors = {t.name: t for t in inputs}
    twice = sorted(name for name, n in Counter(t.name for t in inputs).items() if n > 1)
    if twice:
        raise InvalidRequest(f"inputs {twice} are given more than once", "inputs")
    unknown = sorted(set(tensors) - set(INPUTS))
    if unknown or "question" not in tensors or "options" not in tensors:
        raise InvalidRequest(f"inputs are question [B] and options [B, C] (BYTES), context [B] optional; got "
                             f"{sorted(tensors)}", "inputs")
    rows = tensors["question"].shape[0] if tensors["question"].shape else 0
    if limit is not None and rows > limit:
        raise TooLarge(too_many_items(rows, limit), "inputs")
    questions = [row[0] for row in strings(tensors["question"], None)]
    options = strings(tensors["options"], len(questions))
    contexts = [row[0] or None for row in strings(tensors["context"], len(questions))] if "context" in tensors \
        else [None] * len(questions)
    try:
        return [PredictRequest(question=q, options=o, context=c, adapter=model)
                for q, o, c in zip(questions, options, contexts, strict=True)]
    except ValueError as e:  # pydantic's check of one item: the message names the field
        raise InvalidRequest(f"an item is not a question: {e}", "inputs") from None


def outputs_of(runtime) -> list[str]:
    """The outputs adapter ``runtime`` answers: all, less the Dirichlet's where its head answers none."""
    return [n for n in OUTPUTS if runtime.dirichlet or n not in DIRICHLET]


def chosen_outputs(names: list[str] | None, runtime) -> list[str]:
    """The outputs a request asks of adapter ``runtime`` (None: all it has), checked before the model runs:
    InvalidRequest for one it does not have or one asked twice."""
    has = outputs_of(runtime)
    if names is None:
        return has
    unknown = sorted(set(names) - set(has), key=str)
    if unknown:
        without = [n for n in unknown if n in DIRICHLET]
        raise InvalidRequest(f"unknown outputs {unknown}; model {runtime.name!r} has {has}"
                             + (f" ({without}: its head answers no Dirichlet)" if without else ""), "outputs")
    if len(set(names)) != len(names):
        raise InvalidRequest(f"outputs {sorted({n for n in names if names.count(n) > 1})} are asked more than once",
                             "outputs")
    return names


def in_version(runtime, version: str | None):
    """``runtime`` when ``version`` (a request's model version; None or "": any) is the one it serves; UnknownAdapter
    (the protocol's "no such model") otherwise."""
    if version and version != runtime.ref["version"]:
        raise UnknownAdapter(f"model {runtime.name!r} is served at version {runtime.ref['version']!r}, not "
                             f"{version!r}", "model_version")
    return runtime


def to_outputs(answers: list, names: list[str]) -> list[Tensor]:
    """The output tensors ``names`` (:func:`chosen_outputs`) of ``answers`` (PredictResponse)."""
    out = []
    for name in names:
        datatype, tail, value = OUTPUTS[name]
        rows = [value(a) for a in answers]
        shape = [len(answers), *([len(rows[0])] if tail and rows else [])]
        out.append(Tensor(name, datatype, shape, flat(rows)))
    return out


def model_metadata(runtime) -> dict:
    """What the protocol's model metadata says of an adapter runtime."""
    return {"name": runtime.name, "versions": [runtime.ref["version"]], "platform": "ibedl",
            "inputs": [{"name": n, "datatype": "BYTES", "shape": s} for n, s in INPUTS.items()],
            "outputs": [{"name": n, "datatype": OUTPUTS[n][0], "shape": [-1, *([-1] if OUTPUTS[n][1] else [])]}
                        for n in outputs_of(runtime)]}


def package_version() -> str:
    try:
        return version("ibedl")
    except PackageNotFoundError:
        return "unknown"
