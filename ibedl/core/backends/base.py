"""What a backend declares (:class:`Backend`) and what building one gives the predictor (:class:`Built`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


class Backend(Protocol):
    """An inference backend of the trunk: one module per backend declares one (``BACKEND``), and one line of
    ``ibedl.core.backends.REGISTRY`` lists it.

    Callers ask a backend these instead of testing its name.

    Attributes:
        name: what ``IBEDL_BACKEND`` and ``--backend`` call it.
        precision: what its matmuls compute in (f32, bf16; torch: the model's dtype, ``model``).
        auto: whether ``auto`` may choose it (ibedl.core.auto_backend.candidate_names).
        build_cost: what building its trunk from an empty cache costs, as a rank: 0 nothing (the model as loaded),
            1 an IR export (about a minute), 2 that export compiled or compressed further, 3 a quantisation on
            sample activations (NNCF: minutes, and a process near 3 GiB). ``auto``'s background builds the cheapest
            first.
        static_int8: quantised on the artifact's quantisation sample, weights and activations int8
            (ibedl.core.quantization_sample): its calibration holds only for a trunk quantised on the sample it
            records and run on the CPU int8 class it records, and raw outputs computed on it record that class.
    """

    name: str
    precision: str
    auto: bool
    build_cost: int
    static_int8: bool

    def calibration_key(self, device="cpu", dtype="float32", load_in_4bit: bool = False) -> str:
        """The name of the arithmetic it computes in, as calibrations are keyed (the manifest's ``calibrated_on``
        and ``backend_calibrations``)."""

    def owns_key(self, key: str) -> bool:
        """Whether the calibration key ``key`` names arithmetic of this backend, in any precision and on any device
        (``torch-fp32`` and ``torch-cuda-bf16`` are torch's)."""

    def unavailable(self, predictor, artifact: Path) -> str | None:
        """Why this machine cannot run it for ``predictor`` (loaded from ``artifact``), or None when it can."""

    def build(self, predictor, artifact: Path, base_sha256: str, export: bool = True):
        """The trunk callable (an encoded batch -> (B, d) last-token hidden states), None when the predictor's own
        model answers; its IR built first when not cached (``export``; else FileNotFoundError)."""

    def export(self, predictor, artifact: Path, base_sha256: str, copy_model: bool = True) -> Path:
        """Build what it loads ahead of serving (an IR into the cache); its directory."""

    def quantized_on(self, artifact: Path) -> str | None:
        """sha256 of the sample a quantised trunk is calibrated on (its calibration must record it), else None."""


def preparation(trunk) -> Iterator[Callable[[], object]]:
    """The steps ``trunk`` asks to have run, each on the thread that will call it, before it serves (a graphed trunk's
    captures, one shape a step: ibedl.core.backends.cuda_graphs); none for any other trunk (or None: torch's model)."""
    prepare = getattr(trunk, "prepare", None)
    return iter(()) if prepare is None else prepare()


@dataclass(frozen=True)
class Built:
    """A built backend, for :meth:`ibedl.core.predictor.Predictor.serve_on`: the trunk (None: the torch model),
    the concrete backend's name, why it was chosen, what ``auto`` measured (None: not auto) and the quantisation
    sample a static int8 trunk was made on."""

    trunk: object
    backend: str
    reason: str = "named"
    choice: object = None
    quantized_on: str | None = None
