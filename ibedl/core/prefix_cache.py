"""A trunk that runs only the top layers: the states entering layer ``n`` are computed once per prompt and cached.

When a run trains LoRA in the top ``K`` decoder layers only (``train_layers: K``), the layers below are frozen and
deterministic, so the residual stream entering the first trained layer depends only on the prompt. This trunk
stores it on disk (safetensors, one file per prompt, keyed by the prompt's token ids and a digest of the frozen
layers' weights) and runs the top layers, the final norm and the last-token gather on it. Training and
evaluation then cost about K / L of the full forward (SmolLM2-135M: L = 30). The artifact it produces is an
ordinary PEFT adapter: the full forward gives the same hidden states (checked on a probe at construction).

What differs from running the whole model: the frozen layers' LoRA dropout never applies (they run in eval mode),
so MC-Dropout samples masks in the top layers only.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import logging
import os
import tempfile
from pathlib import Path

import numpy as np
import torch

from ibedl.core.base_model import cache_dir, decoder_of

log = logging.getLogger(__name__)

CACHE_FORMAT = 1  # bump when what a cache file holds changes
PROBE_TOLERANCE = 1e-4  # max |h_full - h_split| / max |h_full| on the probe


def _view(decoder: torch.nn.Module, layers: list[torch.nn.Module], norm: torch.nn.Module) -> torch.nn.Module:
    """The decoder with another layer list and final norm, sharing every weight with it."""
    view = copy.copy(decoder)
    view._modules = dict(decoder._modules)
    view._modules["layers"] = torch.nn.ModuleList(layers)
    view._modules["norm"] = norm
    return view


def plain(t: torch.Tensor) -> torch.Tensor:
    """An integer input as a plain tensor. Under torch.func transforms (laplace-torch's Jacobians) the inputs reach
    the trunk wrapped, without storage to hash; token ids and masks carry no gradient, so unwrapping them is exact."""
    from torch._C import _functorch

    while _functorch.is_functorch_wrapped_tensor(t):
        if _functorch.is_batchedtensor(t):
            raise ValueError("the prefix cache cannot run under vmap over the batch of questions")
        t = _functorch.get_unwrapped(t)
    return t


@contextlib.contextmanager
def eval_mode(module: torch.nn.Module):
    """``module`` and its children in eval mode (dropout off) inside the block; their modes restored after."""
    modes = [(m, m.training) for m in module.modules()]
    try:
        for m, _ in modes:
            m.training = False
        yield
    finally:
        for m, mode in modes:
            m.training = mode


def layer_index(name: str) -> int | None:
    """The decoder layer a parameter name belongs to (``...layers.12.self_attn...`` -> 12), None outside layers."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "layers" and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


def num_layers(model) -> int:
    return len(decoder_of(model).layers)


def check_train_layers(model, train_layers: int) -> int:
    """The first trained layer for ``train_layers`` top layers; a ValueError naming a bad value."""
    total = num_layers(model)
    if not 1 <= train_layers <= total:
        raise ValueError(f"train_layers must be in 1..{total} (the model's decoder layers), got {train_layers}")
    return total - train_layers


def freeze_below(model, first: int) -> int:
    """Turn off gradients of every parameter in layers below ``first``; returns how many tensors were frozen."""
    frozen = 0
    for name, param in model.named_parameters():
        index = layer_index(name)
        if index is not None and index < first and param.requires_grad:
            param.requires_grad_(False)
            frozen += 1
    return frozen


class PrefixCachedTrunk:
    """``trunk(batch)`` -> (B, d) last-token hidden states, running layers ``first..L-1`` on cached states.

    Args:
        predictor: the :class:`~ibedl.core.predictor.Predictor` whose model it runs (PEFT or plain).
        first: the first layer run live; layers ``0..first-1`` are read from the cache.
        base_sha256: the base model's digest (part of the cache key).
        root: cache directory (default ``IBEDL_CACHE_DIR/prefix``).
    """

    def __init__(self, predictor, first: int, base_sha256: str, root: Path | None = None) -> None:
        decoder = decoder_of(predictor.model)
        total = len(decoder.layers)
        if not 1 <= first < total:
            raise ValueError(f"the first live layer must be in 1..{total - 1}, got {first}")
        self.predictor, self.first, self.base_sha256 = predictor, first, base_sha256
        self.root = Path(root) if root is not None else cache_dir() / "prefix"
        self.bottom = _view(decoder, list(decoder.layers[:first]), torch.nn.Identity())
        self.top = _view(decoder, list(decoder.layers[first:]), decoder.norm)
        self._digests: dict[str, str] = {}
        self.check_probe()

    # -- keys -----------------------------------------------------------------------------------

    def _adapter(self) -> str:
        active = getattr(self.predictor.model, "active_adapter", None)
        return active if isinstance(active, str) else str(active)

    def digest(self) -> str:
        """Digest of what the cached states depend on: base model, the frozen layers' weights of the active
        adapter (LoRA and any others that a run may have changed; not the adapter's name), the split and the cache
        format."""
        adapter = self._adapter()
        if adapter not in self._digests:
            h = hashlib.sha256(f"{self.base_sha256}\0{self.first}\0{CACHE_FORMAT}\0".encode())
            for name, param in sorted(self.predictor.model.named_parameters()):
                index = layer_index(name)
                if index is None or index >= self.first or "lora_" not in name:
                    continue
                if ".lora_" in name and f".{adapter}." not in name:
                    continue  # another ensemble member's weights
                # by value, not by adapter name: ensemble members whose frozen layers hold the same weights (all
                # warm-started from one MAP adapter) share one cache with it
                h.update(name.replace(f".{adapter}.", ".").encode())
                h.update(param.detach().float().cpu().numpy().tobytes())
            self._digests[adapter] = h.hexdigest()[:24]
        return self._digests[adapter]

    def _path(self, ids: list[int]) -> Path:
        key = hashlib.sha256(np.asarray(ids, dtype=np.int64).tobytes()).hexdigest()[:32]
        return self.root / self.digest() / key[:2] / f"{key}.safetensors"

    # -- states ---------------------------------------------------------------------------------

    def _compute(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B, S, d) states entering layer ``first``, dropout off, no gradient."""
        with eval_mode(self.bottom), torch.no_grad():
            device = self.predictor.device
            out = self.bottom(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), use_cache=False)
        return out.last_hidden_state.float()

    def states(self, batch) -> torch.Tensor:
        """(B, S, d) cached states of an encoded batch (zeros at padded positions); missing ones computed and saved."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file, save_file

        # Python lists and unwrapped tensors: under torch.func transforms every new tensor is a wrapper without storage
        lengths = [sum(row) for row in batch.attention_mask.tolist()]
        rows = [row[:n] for row, n in zip(batch.input_ids.tolist(), lengths, strict=True)]
        paths = [self._path(r) for r in rows]
        out = torch.zeros(len(rows), batch.input_ids.shape[1], self.bottom.config.hidden_size)
        missing = []
        for i, path in enumerate(paths):
            try:
                out[i, : lengths[i]] = load_file(path)["h"]
            except (OSError, KeyError, RuntimeError, ValueError, SafetensorError):
                missing.append(i)  # absent, or a torn file from a killed writer: compute it again
        if missing:
            width = max(lengths[i] for i in missing)
            ids = torch.tensor([rows[i] + [0] * (width - lengths[i]) for i in missing])
            mask = torch.tensor([[1] * lengths[i] + [0] * (width - lengths[i]) for i in missing])
            states = plain(self._compute(ids, mask)).cpu()
            for j, i in enumerate(missing):
                h = plain(states[j, : lengths[i]].contiguous())
                out[i, : lengths[i]] = h
                paths[i].parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=paths[i].parent, suffix=".tmp")
                os.close(fd)
                save_file({"h": h}, tmp)
                os.replace(tmp, paths[i])  # atomic: concurrent jobs may write the same prompt
        return out

    def __call__(self, batch) -> torch.Tensor:
        device = self.predictor.device
        batch = type(batch)(plain(batch.input_ids), plain(batch.attention_mask), plain(batch.last_index),
                            batch.option_mask)
        states = self._top(self.states(batch), batch.attention_mask)
        return states[torch.arange(states.shape[0], device=states.device), batch.last_index.to(device)]

    def _top(self, h: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B, S, d) states entering layer ``first`` (float32, as cached) -> (B, S, d) last hidden states of the
        live layers, run in the model's dtype on its device."""
        device = self.predictor.device
        h = h.to(device=device, dtype=self.bottom.embed_tokens.weight.dtype)
        return self.top(inputs_embeds=h, attention_mask=attention_mask.to(device), use_cache=False).last_hidden_state

    def differentiable(self, name: str) -> bool:
        """Whether a parameter of the model gets a gradient through this trunk (layers ``first..`` and the head)."""
        index = layer_index(name)
        return index is None or index >= self.first

    def check_probe(self) -> None:
        """Split forward == full forward on a probe batch, or a ValueError: an architecture that transforms
        ``inputs_embeds`` (or numbers its layers) differently cannot be split here."""
        from ibedl.core.prompt import MCQuestion

        p = self.predictor
        enc = p.encode([MCQuestion("probe", ("a", "b")), MCQuestion("a longer probe question here?", ("x", "y", "z"))])
        with eval_mode(p.model), torch.no_grad():
            device = p.device
            full = p.decoder(input_ids=enc.input_ids.to(device), attention_mask=enc.attention_mask.to(device),
                             use_cache=False).last_hidden_state
            full = full[torch.arange(full.shape[0], device=device), enc.last_index.to(device)]
            split = self._top(self._compute(enc.input_ids, enc.attention_mask), enc.attention_mask)
            split = split[torch.arange(split.shape[0], device=device), enc.last_index.to(device)]
        err = float((full - split).abs().max() / full.abs().max().clamp_min(1e-12))
        if not err <= PROBE_TOLERANCE:
            raise ValueError(f"cannot split {type(p.decoder).__name__} at layer {self.first}: the split forward "
                             f"differs from the full one by {err:.2e} (relative); train all layers "
                             "(train_layers: null)")


def attach(predictor, train_layers: int | None, base_sha256: str) -> PrefixCachedTrunk | None:
    """Give ``predictor`` a :class:`PrefixCachedTrunk` when only the top ``train_layers`` layers were trained (None
    or all layers: nothing to cache, the predictor keeps its own forward). Returns the trunk or None."""
    if train_layers is None:
        return None
    first = check_train_layers(predictor.model, train_layers)
    if first == 0:
        return None
    from ibedl.core.backends import Built

    predictor.serve_on(Built(PrefixCachedTrunk(predictor, first, base_sha256), predictor.backend,
                             f"layers below {first} read from the prefix cache"))
    log.info("layers 0..%d read from the prefix cache %s; layers %d..%d run live", first - 1, predictor.trunk.root,
             first, first + train_layers - 1)
    return predictor.trunk


__all__ = ["attach", "PrefixCachedTrunk", "check_train_layers", "freeze_below", "layer_index", "num_layers"]
