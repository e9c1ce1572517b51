"""Laplace-LoRA: a Laplace posterior over the LoRA weights of a trained MAP adapter (laplace-torch).

KFAC ("kron") generalised Gauss-Newton over every LoRA matrix, the prior precision chosen by the validation NLL of
the predictive (or fitted by the marginal likelihood, or given), and the GLM predictive with the probit
approximation. Needs laplace-torch (``make setup`` installs it from requirements/lock.txt); the service never
imports this module.

References:
    Yang et al. Bayesian Low-rank Adaptation for Large Language Models. ICLR 2024.
    Daxberger et al. Laplace Redux - Effortless Bayesian Deep Learning. NeurIPS 2021.
"""

from __future__ import annotations

import logging
import math
import time
from collections import UserDict

import torch
from torch import nn
from tqdm import tqdm

from ibedl.core.predictor import EncodedBatch, Prediction, Predictor
from ibedl.core.prompt import LETTERS, MCQuestion

log = logging.getLogger("ibedl.training.laplace_lora")

# glm: the linearised model with the probit approximation (Laplace-LoRA's predictive; per-question Jacobians over
# the LoRA weights: about 0.4-0.9 s a SciQ question on one CPU core for the top 4 layers of SmolLM2); mc: the mean
# softmax over weight samples from the posterior, one forward pass each.
PREDICTIVES = ("glm", "mc")
PRIORS = ("validation", "marglik")  # how the prior precision is chosen when it is not given as a number
PRIOR_GRID = tuple(10.0 ** (k / 4) for k in range(-8, 25))  # 1e-2 .. 1e6, four values a decade
PAD_LOGIT = -1e4  # padded options: far below any real logit, finite for the Gauss-Newton factors


def probit(f: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """(B, C) probabilities of the probit approximation to E[softmax(f)] under f ~ N(mean, var):
    softmax(f / sqrt(1 + pi var / 8)), with ``f`` and ``var`` (B, C) logit means and variances."""
    return torch.softmax(f / torch.sqrt(1.0 + math.pi / 8.0 * var), dim=-1)


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


def glm_moments(la, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Logit means f (1, C) and Jacobians (1, C, P) over the posterior's weights of a one-question batch.

    One question at a time: torch.func's jacrev over a batch of B questions differentiates each of the B * C
    outputs through the whole batch (the weights are shared), B times the work; on SmolLM2's top 4 layers, one
    core, batch 4 took 6.8 s a question and batch 1 0.9 s, with the same probabilities."""
    with torch.enable_grad():
        js, f = la.backend.jacobians(batch)
    return f.detach(), js.detach()


def logit_variance(la, js: torch.Tensor) -> torch.Tensor:
    """(B, C) variances of the linearised logits, diag(J Sigma J^T), from (B, C, P) Jacobians ``js`` over the
    posterior's P weights, at ``la``'s current prior precision."""
    return torch.diagonal(la.functional_variance(js), dim1=-2, dim2=-1)


class LaplaceLoRA:
    """A fitted posterior and its predictive over option letters.

    ``prior_info`` says how the prior precision was chosen (``prior``: validation, marglik or given), its value
    and, when chosen on validation, the validation NLL at that value and without the posterior (MAP)."""

    def __init__(self, predictor: Predictor, la, width: int, predictive: str = "glm", samples: int = 10,
                 prior_info: dict | None = None) -> None:
        if predictive not in PREDICTIVES:
            raise ValueError(f"predictive must be one of {PREDICTIVES}, got {predictive!r}")
        self.predictor, self.la, self.width = predictor, la, width
        self.predictive, self.samples = predictive, samples
        self.prior_info = prior_info or {}

    def batches(self, questions: list[MCQuestion], batch_size: int) -> list:
        """Encoded batches, as wide as the fit's questions or wider (another stream may have more options)."""
        width = max([self.width] + [q.num_options for q in questions])
        return _Batches(self.predictor, questions, batch_size, width).batches

    def predict(self, questions: list[MCQuestion], batch_size: int = 4) -> tuple[list[list[float]], float]:
        """Predictive probabilities per question (real options only) and the seconds taken: the GLM probit
        approximation (``glm``, one question per Jacobian; see :func:`glm_moments`), or the mean softmax over
        ``samples`` weight draws from the posterior (``mc``, ``batch_size`` questions a pass)."""
        start = time.perf_counter()
        probs: list[list[float]] = []
        for batch in self.batches(questions, 1 if self.predictive == "glm" else batch_size):
            if self.predictive == "glm":
                f, js = glm_moments(self.la, batch)
                p = probit(f, logit_variance(self.la, js))
            else:
                p = self.la(batch, pred_type="nn", link_approx="mc", n_samples=self.samples)
            for row, mask in zip(p.detach().cpu(), batch["option_mask"], strict=True):
                kept = row[mask].double()
                probs.append((kept / kept.sum()).tolist())
        return probs, time.perf_counter() - start


def _check_grid(grid) -> tuple[float, ...]:
    grid = tuple(grid)
    if not grid or not all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in grid):
        raise ValueError(f"grid must be finite numbers > 0, got {grid!r}")
    return grid


def _check_answered(questions: list[MCQuestion], what: str) -> None:
    if not questions or any(q.answer is None for q in questions):
        given = ("none" if not questions else
                 f"{sum(q.answer is None for q in questions)} of {len(questions)} without an answer")
        raise ValueError(f"{what} needs questions with answers, got {given}")


def predictives_over_grid(laplace: LaplaceLoRA, questions: list[MCQuestion], grid=PRIOR_GRID,
                          progress: bool = False) -> tuple[list[list[list[float]]], list[list[float]]]:
    """The GLM probit predictive of ``questions`` at every prior precision of ``grid`` (G lists of N probability
    rows over each question's real options) and the MAP softmax (N rows). Each question's Jacobian is taken once;
    the grid only changes the posterior covariance. Leaves the prior precision at the grid's last value."""
    grid = _check_grid(grid)
    la = laplace.la
    over_grid: list[list[list[float]]] = [[] for _ in grid]
    map_probs: list[list[float]] = []
    for batch in tqdm(laplace.batches(questions, 1), desc="Laplace prior grid", unit="q", leave=False,
                      disable=not progress):
        f, js = glm_moments(la, batch)
        mask = batch["option_mask"][0]
        real = lambda p, mask=mask: (p[0][mask].double() / p[0][mask].double().sum()).tolist()  # noqa: E731
        map_probs.append(real(torch.softmax(f.double(), -1)))
        for i, value in enumerate(grid):
            la.prior_precision = value
            over_grid[i].append(real(probit(f, logit_variance(la, js))))
    return over_grid, map_probs


def grid_edge(grid, value: float) -> str | None:
    """``"top"`` when ``value`` is the largest of ``grid``, ``"bottom"`` when the smallest, else None (also for a grid
    of one value)."""
    if len(set(grid)) < 2:
        return None
    return "top" if value == max(grid) else "bottom" if value == min(grid) else None


def choose_prior_on_validation(laplace: LaplaceLoRA, questions: list[MCQuestion], grid=PRIOR_GRID,
                               progress: bool = False) -> dict:
    """Set the prior precision to the value of ``grid`` whose GLM probit predictive has the lowest NLL on
    ``questions`` (validation questions with answers); returns what was chosen.

    ``at_grid_edge`` is ``"top"`` when the largest value won (the narrowest posterior on the grid: the predictive is
    then within a hair of MAP's, and a larger value could only move it closer), ``"bottom"`` when the smallest did
    (a wider posterior might do better), else None; either edge is logged as a warning."""
    grid = _check_grid(grid)
    _check_answered(questions, "choosing the prior precision on validation")
    over_grid, map_probs = predictives_over_grid(laplace, questions, grid, progress)
    labels = [q.answer for q in questions]
    nll = lambda rows: -sum(math.log(max(p[y], 1e-12)) for p, y in zip(rows, labels, strict=True)) / len(labels)  # noqa: E731
    nlls = [nll(rows) for rows in over_grid]
    best = min(range(len(grid)), key=nlls.__getitem__)
    laplace.la.prior_precision = grid[best]
    edge = grid_edge(grid, grid[best])
    if edge:
        log.warning("Laplace prior precision %.3g is the grid's %s value: %s", grid[best], edge,
                    "the predictive is MAP's within a hair" if edge == "top" else "a wider posterior may do better")
    return {"prior": "validation", "prior_precision": float(grid[best]), "at_grid_edge": edge,
            "validation_nll": nlls[best], "validation_nll_map": nll(map_probs), "validation_questions": len(questions)}


class LaplacePredictor:
    """A :class:`Predictor` whose ``predict`` is the GLM probit predictive of a fitted posterior; everything
    else (model, head, device, manifest, ``eval``) is the MAP predictor's. No uncertainty mass (not a Dirichlet)."""

    def __init__(self, laplace: LaplaceLoRA, batch_size: int = 4) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.laplace, self.batch_size = laplace, batch_size

    def __getattr__(self, name):
        return getattr(self.laplace.predictor, name)

    @property
    def predictive_fit_info(self) -> dict:
        """How the posterior's prior precision was chosen (:attr:`LaplaceLoRA.prior_info`)."""
        return self.laplace.prior_info

    def eval(self) -> LaplacePredictor:
        self.laplace.predictor.eval()
        return self

    def predict(self, questions: list[MCQuestion], truncate_context: bool = True) -> list[Prediction]:
        with torch.enable_grad():  # the GLM predictive takes Jacobians, also when called under no_grad
            probs, _ = self.laplace.predict(questions, batch_size=self.batch_size)
        preds = []
        for p in probs:
            idx = max(range(len(p)), key=p.__getitem__)
            preds.append(Prediction(index=idx, letter=LETTERS[idx], confidence=float(p[idx]),
                                    probs=[float(x) for x in p], alpha=None, belief=None, uncertainty=None,
                                    sigma=None))
        return preds


def fit_laplace(predictor: Predictor, questions: list[MCQuestion], prior_precision: float | str = "validation",
                validation: list[MCQuestion] | None = None, batch_size: int = 4, predictive: str = "glm",
                samples: int = 10) -> LaplaceLoRA:
    """Fit a KFAC Laplace posterior over the LoRA weights on ``questions`` (training data with answers).

    ``prior_precision``: a number > 0; ``"validation"``: the value of :data:`PRIOR_GRID` with the lowest NLL of the
    GLM predictive on ``validation`` (questions with answers); ``"marglik"``: fitted by the marginal likelihood on
    ``questions`` (Laplace-LoRA's choice; with a few hundred questions here it gave a far too wide posterior)."""
    from laplace import Laplace

    if any(q.answer is None for q in questions):
        raise ValueError("fit_laplace needs questions with answers")
    if isinstance(prior_precision, str):
        if prior_precision not in PRIORS:
            raise ValueError(f"prior_precision must be a number > 0 or one of {PRIORS}, got {prior_precision!r}")
        if prior_precision == "validation":
            _check_answered(validation or [], "prior_precision 'validation'")
    elif not (isinstance(prior_precision, (int, float)) and not isinstance(prior_precision, bool)
              and math.isfinite(prior_precision) and prior_precision > 0):
        raise ValueError(f"prior_precision must be a number > 0 or one of {PRIORS}, got {prior_precision!r}")
    # The posterior is over the LoRA weights the predictor's forward differentiates: all of them, or with a
    # prefix-cached trunk (ibedl.core.prefix_cache) those of the layers it runs live.
    differentiable = getattr(predictor.trunk, "differentiable", lambda name: True)
    for name, param in predictor.model.named_parameters():
        param.requires_grad_("lora_" in name and differentiable(name))
    for param in predictor.head.parameters():
        param.requires_grad_(False)
    predictor.model.eval()
    width = max(q.num_options for q in questions)
    module = OptionLogits(predictor)
    given = not isinstance(prior_precision, str)
    la = Laplace(module, "classification", subset_of_weights="all", hessian_structure="kron",
                 prior_precision=float(prior_precision) if given else 1.0)
    la.fit(_Batches(predictor, questions, batch_size, width).loader(), progress_bar=False)
    laplace = LaplaceLoRA(predictor, la, width, predictive, samples)
    if prior_precision == "validation":
        laplace.prior_info = choose_prior_on_validation(laplace, validation)
    elif prior_precision == "marglik":
        la.optimize_prior_precision(method="marglik", n_steps=100, lr=0.1)
        laplace.prior_info = {"prior": "marglik", "prior_precision": float(la.prior_precision)}
    else:
        laplace.prior_info = {"prior": "given", "prior_precision": float(prior_precision)}
    laplace.prior_info["fit_questions"] = len(questions)
    return laplace
