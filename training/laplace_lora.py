"""Laplace-LoRA: a post-hoc Laplace posterior over the LoRA weights of a MAP adapter (laplace-torch).

KFAC ("kron") generalised Gauss-Newton over every LoRA matrix, the prior precision fitted by the
marginal likelihood, and the GLM predictive with the probit approximation. Needs the ``laplace`` extra
(``make setup-laplace``); the service never imports this module.

References:
    Yang et al. Bayesian Low-rank Adaptation for Large Language Models. ICLR 2024.
    Daxberger et al. Laplace Redux - Effortless Bayesian Deep Learning. NeurIPS 2021.
"""

from __future__ import annotations

import time
from collections import UserDict

import torch
from torch import nn

from evidential.predictor import EncodedBatch, Prediction, Predictor
from evidential.prompt import LETTERS, MCQuestion

# glm: the linearised model with the probit approximation (Laplace-LoRA's predictive; per-question Jacobians over
# the LoRA weights: about 10 s a SciQ question on one CPU core for the top 4 layers of SmolLM2); mc: the mean softmax
# over weight samples from the posterior, one forward pass each.
PREDICTIVES = ("glm", "mc")
PAD_LOGIT = -1e4  # padded options: far below any real logit, finite for the Gauss-Newton factors


class OptionLogits(nn.Module):
    """The MAP predictor as a plain module: a dict batch -> (B, C) option logits."""

    def __init__(self, predictor: Predictor) -> None:
        super().__init__()
        self.predictor = predictor
        self.model = predictor.model
        self.head = predictor.head

    def forward(self, batch) -> torch.Tensor:
        enc = EncodedBatch(batch["input_ids"], batch["attention_mask"], batch["last_index"], batch["option_mask"])
        mask = enc.option_mask.to(self.predictor.device)
        logits = self.head(self.predictor.hidden(enc), mask).logits
        return logits.masked_fill(~mask, PAD_LOGIT)


class _Batches(torch.utils.data.Dataset):
    """Pre-encoded dict batches; laplace-torch reads ``len(loader.dataset)`` as the data count N."""

    def __init__(self, predictor: Predictor, questions: list[MCQuestion], batch_size: int, width: int) -> None:
        self.n = len(questions)
        self.batches = []
        for i in range(0, len(questions), batch_size):
            chunk = questions[i : i + batch_size]
            enc = predictor.encode(chunk)
            mask = torch.zeros(len(chunk), width, dtype=torch.bool)
            mask[:, : enc.option_mask.shape[1]] = enc.option_mask
            item = UserDict(input_ids=enc.input_ids, attention_mask=enc.attention_mask, last_index=enc.last_index,
                            option_mask=mask)
            if chunk[0].answer is not None:
                item["labels"] = torch.tensor([q.answer for q in chunk])
            self.batches.append(item)

    def __len__(self) -> int:
        return self.n

    def loader(self):
        return _Loader(self)


class _Loader:
    def __init__(self, dataset: _Batches) -> None:
        self.dataset = dataset

    def __iter__(self):
        return iter(self.dataset.batches)

    def __len__(self) -> int:
        return len(self.dataset.batches)


class LaplaceLoRA:
    """A fitted posterior and its predictive over option letters."""

    def __init__(self, predictor: Predictor, la, width: int, predictive: str = "glm", samples: int = 10) -> None:
        if predictive not in PREDICTIVES:
            raise ValueError(f"predictive must be one of {PREDICTIVES}, got {predictive!r}")
        self.predictor, self.la, self.width = predictor, la, width
        self.predictive, self.samples = predictive, samples

    def predict(self, questions: list[MCQuestion], batch_size: int = 4) -> tuple[list[list[float]], float]:
        """Predictive probabilities per question (real options only) and the seconds taken: the GLM probit
        approximation (``glm``), or the mean softmax over ``samples`` weight draws from the posterior (``mc``)."""
        start = time.perf_counter()
        probs: list[list[float]] = []
        for batch in _Batches(self.predictor, questions, batch_size, self.width).batches:
            if self.predictive == "glm":
                p = self.la(batch, pred_type="glm", link_approx="probit")
            else:
                p = self.la(batch, pred_type="nn", link_approx="mc", n_samples=self.samples)
            for row, mask in zip(p.detach().cpu(), batch["option_mask"]):
                kept = row[mask].double()
                probs.append((kept / kept.sum()).tolist())
        return probs, time.perf_counter() - start


class LaplacePredictor:
    """A :class:`Predictor` whose ``predict`` is the GLM probit predictive of a fitted posterior; everything
    else (model, head, device, manifest, ``eval``) is the MAP predictor's. No uncertainty mass (not a Dirichlet)."""

    def __init__(self, laplace: LaplaceLoRA, batch_size: int = 4) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.laplace, self.batch_size = laplace, batch_size

    def __getattr__(self, name):
        return getattr(self.laplace.predictor, name)

    def eval(self) -> LaplacePredictor:
        self.laplace.predictor.eval()
        return self

    def predict(self, questions: list[MCQuestion], truncate_context: bool = True) -> list[Prediction]:
        with torch.enable_grad():  # the GLM predictive takes Jacobians, also when called under no_grad
            probs, _ = self.laplace.predict(questions, batch_size=self.batch_size)
        preds = []
        for p in probs:
            idx = max(range(len(p)), key=p.__getitem__)
            preds.append(Prediction(index=idx, letter=LETTERS[idx], confidence=float(p[idx]), probs=[float(x) for x in p],
                                    alpha=None, belief=None, uncertainty=None, sigma=None))
        return preds


def fit_laplace(predictor: Predictor, questions: list[MCQuestion], prior_precision: float | None = None,
                batch_size: int = 4, predictive: str = "glm", samples: int = 10) -> LaplaceLoRA:
    """Fit a KFAC Laplace posterior over the LoRA weights on ``questions`` (training data with answers)."""
    from laplace import Laplace

    if any(q.answer is None for q in questions):
        raise ValueError("fit_laplace needs questions with answers")
    # The posterior is over the LoRA weights the predictor's forward differentiates: all of them, or with a
    # prefix-cached trunk (evidential.prefix_cache) those of the layers it runs live.
    differentiable = getattr(predictor.trunk, "differentiable", lambda name: True)
    for name, param in predictor.model.named_parameters():
        param.requires_grad_("lora_" in name and differentiable(name))
    for param in predictor.head.parameters():
        param.requires_grad_(False)
    predictor.model.eval()
    width = max(q.num_options for q in questions)
    module = OptionLogits(predictor)
    la = Laplace(module, "classification", subset_of_weights="all", hessian_structure="kron",
                 prior_precision=prior_precision or 1.0)
    la.fit(_Batches(predictor, questions, batch_size, width).loader(), progress_bar=False)
    if prior_precision is None:
        la.optimize_prior_precision(method="marglik", n_steps=100, lr=0.1)
    return LaplaceLoRA(predictor, la, width, predictive, samples)
