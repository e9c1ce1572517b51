"""What a training method is: a head kind, a loss over the head's outputs, and its hyper-parameters."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from evidential.head import HeadPrediction


@dataclass
class LossContext:
    """What a loss may need beyond outputs and targets.

    Attributes:
        progress: fraction of training done, in [0, 1] (for annealed regularisers).
        generator: RNG for sampling losses (IB-EDL), seeded by the training loop.
    """

    progress: float = 1.0
    generator: torch.Generator | None = None


LossFn = Callable[[HeadPrediction, torch.Tensor, torch.Tensor, dict, LossContext], dict]


@dataclass(frozen=True)
class Method:
    """A training method of the registry.

    Attributes:
        name: registry key (``map``, ``edl``, ``ib_edl``, ...).
        head: head kind in ``evidential.head.HEADS``.
        loss: ``loss(out, y, mask, params, ctx) -> {"loss": (B,), <parts>: (B,)}``.
        defaults: hyper-parameters with their default values; a config may override them.
        clip_grad_norm: gradient clipping (20 for the EDL family as in the paper, 1 otherwise).
        head_offset: alpha = evidence + offset, from ``params`` key when a str, else the number.
        check: ``check(params)`` raises ValueError naming a bad hyper-parameter value (optional).
    """

    name: str
    head: str
    loss: LossFn
    defaults: dict = field(default_factory=dict)
    clip_grad_norm: float = 1.0
    head_offset: float | str = 1.0
    check: Callable[[dict], None] | None = None

    def params(self, overrides: dict | None = None) -> dict:
        """Defaults updated by ``overrides``; unknown keys are an error naming them."""
        overrides = dict(overrides or {})
        unknown = sorted(set(overrides) - set(self.defaults))
        if unknown:
            raise ValueError(f"method {self.name!r} has no hyper-parameters {unknown}; known: {sorted(self.defaults)}")
        params = {**self.defaults, **overrides}
        if self.check is not None:
            self.check(params)
        return params

    def offset(self, params: dict) -> float:
        return float(params[self.head_offset]) if isinstance(self.head_offset, str) else float(self.head_offset)
