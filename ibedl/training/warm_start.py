"""Warm start: begin a run from a trained artifact's LoRA weights and option rows (``init_from``).

The paper fine-tunes 7B+ models that already answer multiple-choice questions zero-shot, so IB-EDL's
head starts from option rows that rank the answers. SmolLM2-135M answers at chance until it has been
fine-tuned (README, "Choosing a base model and recipe"), and an evidential head trained from there
spends its first ~150 steps with collapsed or inflated evidence (README, "The default adapter").
``init_from: artifacts/map`` gives every method the paper's starting point: a trunk and option rows
that already answer. The source must share the base model, the option tokens and the LoRA shape.

What is copied:
    LoRA weights    all of them (``adapter_model.safetensors``).
    head            every tensor when the source head is of the same kind; otherwise its option rows
                    (``weight`` of softmax and evidential heads, ``mu_weight`` of IB-EDL) become the new
                    head's rows, and the rest is initialised as for a fresh run (IB-EDL's sigma head
                    from scale * rows; the shared evidence bias centred on the first batch).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from ibedl.core.artifact import ADAPTER_FILES, HEAD_FILE, ArtifactError, Manifest, check_artifact
from ibedl.core.head import HEADS


def read_source(directory: str | Path, sha256: str, option_ids: list[int], lora) -> Manifest:
    """Check that the artifact at ``directory`` can seed a run on this base model and LoRA shape.

    Args:
        sha256: the run's base weights; option_ids: its option-token ids;
        lora: the run's ``LoraSettings`` (r, alpha, targets must match the source's adapter).
    Raises ValueError naming what differs.
    """
    directory = Path(directory)
    try:
        manifest = check_artifact(directory)
    except (ArtifactError, FileNotFoundError) as e:
        raise ValueError(f"init_from {directory}: {e}") from e
    if manifest.members != ["."]:
        raise ValueError(f"init_from {directory}: an ensemble ({len(manifest.members)} members) cannot seed one "
                         "adapter")
    base = manifest.base_model_ref()
    if base.sha256 != sha256:
        raise ValueError(f"init_from {directory}: trained on {base.name} "
                         f"(sha256 {base.sha256[:12]}), this run's base has sha256 {sha256[:12]}")
    if manifest.option_token_ids[: len(option_ids)] != list(option_ids):
        raise ValueError(f"init_from {directory}: option token ids {manifest.option_token_ids} differ from "
                         f"{option_ids}")
    config = json.loads((directory / ADAPTER_FILES[0]).read_text())
    theirs = (config.get("r"), config.get("lora_alpha"), sorted(config.get("target_modules") or []))
    ours = (lora.r, lora.alpha, sorted(lora.targets))
    if theirs != ours:
        raise ValueError(f"init_from {directory}: its LoRA (r, alpha, targets) = {theirs}, this run's = {ours}")
    return manifest


def source_rows(directory: str | Path, manifest: Manifest) -> torch.Tensor:
    """The source head's option rows, (num_rows, d)."""
    tensors = load_file(str(Path(directory) / HEAD_FILE))
    return tensors[HEADS[manifest.head_config().kind].weight_name].float()


@torch.no_grad()
def load_lora(model, directory: str | Path) -> int:
    """Copy the source's LoRA tensors into ``model`` (a PEFT model with the same LoRA shape). Returns how many.

    Every LoRA tensor of the model must be set, and every source tensor used.
    """
    from peft import set_peft_model_state_dict

    state = load_file(str(Path(directory) / ADAPTER_FILES[1]))
    result = set_peft_model_state_dict(model, state)
    unexpected = list(getattr(result, "unexpected_keys", []))
    lora_names = {n for n, p in model.named_parameters() if p.requires_grad}
    missing = sorted(lora_names & set(getattr(result, "missing_keys", [])))
    if unexpected or missing:
        raise ValueError(f"init_from {directory}: LoRA tensors missing {missing[:3]}..., unexpected "
                         f"{unexpected[:3]}...")
    return len(state)


def load_head_tensors(head: torch.nn.Module, directory: str | Path) -> None:
    """Every tensor of a same-kind source head into ``head``."""
    missing, unexpected = head.load_state_dict(load_file(str(Path(directory) / HEAD_FILE)), strict=False)
    if missing or unexpected:
        raise ValueError(f"init_from {directory}: head tensors missing {missing}, unexpected {unexpected}")


__all__ = ["read_source", "source_rows", "load_lora", "load_head_tensors"]
