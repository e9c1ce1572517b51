"""What the CUDA torch backends share: the base model loaded a second time, in the backend's arithmetic on the
predictor's CUDA device, with the artifact's adapter (:func:`load_trunk`), so that ``auto`` can time the arithmetics
an artifact carries calibrations for (``torch-cuda-fp32``, ``torch-cuda-bf16``, ``torch-cuda-nf4-bf16``,
``torch-cuda-merged-fp32``, ``torch-cuda-merged-bf16``, ``torch-cuda-graphs-fp32``, ``torch-cuda-graphs-bf16``)
whatever the service loaded, and serve the calibration made on the one it runs.

A merged backend folds the adapter into the base's weights (W + B A s, PEFT's ``merge_and_unload``): the same
function, rounded once where the unmerged trunk rounds the base's product and the adapter's apart, with half the
operations a forward dispatches (each of SmolLM2-135M's 210 LoRA layers is otherwise the base's matmul plus the
adapter's dropout, two small matmuls, a scale, an add and, in bf16, casts to and from its float32 weights:
``python -m benchmarks.merged_adapter``: 12,118 against 5,818 ATen operators for one question). A GPU pass of a few
questions is likely bound by dispatching operations, not by running them (``gpu_serve_profile.json``: 150-190 ms for
about 3 questions on an H200), which is what merging saves; ``auto`` times it. It is its own arithmetic, so its own
calibration key: calibrated with ``--backend torch-cuda-merged-<precision>``. Never on a 4-bit base (the merge would
quantise the adapter's update into NF4).

A graphed backend (``torch-cuda-graphs-<precision>``) is the merged trunk replayed from CUDA graphs, one per padded
shape (ibedl.core.backends.cuda_graphs): a pass then costs its kernels' time and one launch, not the dispatch of each
operator. Its arithmetic is its own (padded shapes, the causal mask alone), so is its calibration key.

The trunk is loaded as the predictor's own model is (ibedl.core.base_model.load_base_model, then the adapter by PEFT
with its defaults), so an unmerged one computes what ``python -m ibedl.training.calibrate --device cuda --dtype D
[--load-in-4bit]`` computed: each unmerged backend's name is the calibration key torch gives that arithmetic
(ibedl.core.backends.torch_eager).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from ibedl.core.backends.cuda_graphs import GraphedTrunk
from ibedl.core.backends.openvino_ir import LastTokenTrunk
from ibedl.core.backends.torch_eager import BACKEND as TORCH
from ibedl.core.backends.torch_eager import SHORT_DTYPES

log = logging.getLogger(__name__)

PRECISIONS = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}  # a dtype's name -> what Backend.precision says
NO_MERGE_INTO_4BIT = "an adapter is not merged into a 4-bit base: the merge would quantise its update into NF4"


def merged_key(dtype: str) -> str:
    """The calibration key of the adapter merged into a base in ``dtype`` (a torch dtype's name) on CUDA,
    ``torch-cuda-merged-<precision>``: an arithmetic only a merged backend computes. ValueError for an unknown dtype."""
    if dtype not in SHORT_DTYPES:
        raise ValueError(f"no calibration key for dtype {dtype!r}; expected one of {sorted(SHORT_DTYPES)}")
    return f"torch-cuda-merged-{SHORT_DTYPES[dtype]}"


def graphs_key(dtype: str) -> str:
    """The calibration key of the merged trunk in ``dtype`` replayed from CUDA graphs,
    ``torch-cuda-graphs-<precision>``. ValueError for an unknown dtype."""
    return merged_key(dtype).replace("-merged-", "-graphs-")


def has_bitsandbytes() -> bool:
    """Whether bitsandbytes imports here (what NF4 needs: ``pip install -e '.[gpu]'``)."""
    try:
        import bitsandbytes  # noqa: F401
    except Exception:  # not installed, or installed without a CUDA runtime it can load
        return False
    return True


class TorchTrunk:
    """A torch model of its own: ``trunk(batch)`` -> (B, d) hidden states of each prompt's last real token, on the
    model's device and in its dtype (the head reads them as it reads the predictor's own).

    Args:
        model: the base with the adapter (a PEFT model, or the base with the adapter merged into its weights), in
            eval mode.
    """

    def __init__(self, model) -> None:
        from ibedl.core.base_model import decoder_of

        self.model = model
        self.gather = LastTokenTrunk(decoder_of(model)).eval()
        self.device = next(model.parameters()).device

    def __call__(self, batch) -> torch.Tensor:
        # the gather's indices stay on the CPU (allowed for a CUDA tensor); the tokens go to the model's device
        with torch.no_grad():
            return self.gather(batch.input_ids.to(self.device), batch.attention_mask.to(self.device),
                               batch.last_index)


def load_trunk(ref: str, base_sha256: str, adapter: Path, device, dtype: str, load_in_4bit: bool,
               merged: bool = False) -> TorchTrunk:
    """The base model ``ref`` (whose weights must have sha256 ``base_sha256``) with the adapter in directory
    ``adapter``, loaded on ``device`` in ``dtype`` (a torch dtype's name), NF4 with ``load_in_4bit``: as the predictor
    loads its own (ibedl.core.base_model.load_base_model, then PEFT with its defaults), so the trunk computes in the
    arithmetic a calibration made with those settings ran on; ``merged``: the adapter then folded into the base's
    weights (module docstring). ValueError when ``ref`` resolves to other weights than the ones served, or for a
    merge into a 4-bit base."""
    if merged and load_in_4bit:
        raise ValueError(NO_MERGE_INTO_4BIT)
    from peft import PeftModel

    from ibedl.core.base_model import load_base_model, resolve_model

    resolved = resolve_model(ref)
    if resolved.sha256 != base_sha256:
        raise ValueError(f"the base model {ref!r} resolves to weights with sha256 {resolved.sha256[:12]}, not the "
                         f"served ones ({base_sha256[:12]})")
    model, _ = load_base_model(resolved, device=str(device), dtype=getattr(torch, dtype), load_in_4bit=load_in_4bit)
    model = PeftModel.from_pretrained(model, adapter, adapter_name="m0", use_safetensors=True)
    if merged:
        model = model.merge_and_unload()
    return TorchTrunk(model.eval())


@dataclass(frozen=True)
class TorchCudaBackend:
    """A CUDA torch backend: the base model and adapter loaded once more in ``dtype`` (and NF4 with
    ``load_in_4bit``, which needs bitsandbytes) on the predictor's CUDA device, the adapter folded into the base's
    weights where ``merged``, and that merged trunk replayed from CUDA graphs where ``graphs``. Its calibration key is
    its name: the key torch gives the same arithmetic (``torch-cuda-[nf4-]<precision>``), or for a merged one
    ``torch-cuda-merged-<precision>`` and a graphed one ``torch-cuda-graphs-<precision>``, which only this backend
    computes."""

    name: str
    dtype: str  # a torch dtype's name: float32, bfloat16
    load_in_4bit: bool = False
    merged: bool = False
    graphs: bool = False
    auto: bool = True
    build_cost: int = 1  # the base model read from disk again and, for NF4, quantised: seconds
    static_int8: bool = False

    def __post_init__(self) -> None:
        if self.merged and self.load_in_4bit:
            raise ValueError(f"backend {self.name!r}: {NO_MERGE_INTO_4BIT}")
        if self.graphs and not self.merged:
            raise ValueError(f"backend {self.name!r}: the graphed trunk is the merged one (merged=True)")
        key = (graphs_key(self.dtype) if self.graphs else merged_key(self.dtype) if self.merged
               else TORCH.calibration_key("cuda", self.dtype, self.load_in_4bit))
        if self.name != key:
            raise ValueError(f"a CUDA torch backend is named for its arithmetic: {key!r}, got {self.name!r}")
        if self.build_cost < 1:
            raise ValueError(f"backend {self.name!r}: build_cost must be >= 1 (a model is loaded), got "
                             f"{self.build_cost}")

    @property
    def precision(self) -> str:
        """What its matmuls compute in (NF4 weights are dequantised to ``dtype`` for them)."""
        return PRECISIONS[self.dtype]

    def calibration_key(self, device="cuda", dtype="float32", load_in_4bit: bool = False) -> str:
        return self.name  # its own arithmetic, whatever the predictor's model was loaded in

    def owns_key(self, key: str) -> bool:
        return key == self.name

    def unavailable(self, predictor, artifact: Path) -> str | None:
        """Why it cannot run for ``predictor`` here: not on CUDA, several adapters or MC-Dropout (the trunk holds one
        adapter without dropout), a GPU without bfloat16, or NF4 without bitsandbytes; None when it can."""
        if predictor.device.type != "cuda":
            return f"it runs on CUDA; this predictor is on {predictor.device}"
        if len(predictor.heads) > 1 or predictor.mc_samples > 0:
            return "MC-Dropout and ensembles run on torch as loaded"
        if self.dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
            return f"{torch.cuda.get_device_name(predictor.device)} has no bfloat16"
        if self.load_in_4bit and not has_bitsandbytes():
            return "NF4 needs bitsandbytes, which does not import here (pip install -e '.[gpu]')"
        return None

    def build(self, predictor, artifact: Path, base_sha256: str, export: bool = True):
        """The trunk for ``predictor``: its base model (the one loaded, else the manifest's) with the artifact's
        adapter, loaded in this arithmetic on its device (seconds; nothing is cached, so ``export`` changes
        nothing); a graphed one captures its graphs when first used or prepared (not here: a capture belongs on the
        thread that replays it)."""
        why = self.unavailable(predictor, artifact)
        if why is not None:
            raise ValueError(f"backend {self.name!r} cannot run here: {why}")
        model = predictor.model
        ref = model.name_or_path if model is not None else predictor.manifest.base_model_ref().ref
        log.info("loading %s with the adapter of %s on %s for backend %s", ref, artifact, predictor.device, self.name)
        adapter = Path(artifact) / predictor.manifest.members[0]
        trunk = load_trunk(ref, base_sha256, adapter, predictor.device, self.dtype, self.load_in_4bit, self.merged)
        return GraphedTrunk(trunk) if self.graphs else trunk

    def export(self, predictor, artifact: Path, base_sha256: str, copy_model: bool = True) -> Path:
        raise ValueError(f"backend {self.name!r} loads the base model in its arithmetic when it is built: there is "
                         "nothing to export")

    def quantized_on(self, artifact: Path) -> str | None:
        return None
