"""Each head kind's post-hoc step through its object: calibration's float64 outputs equal the served float32 ones,
the fitted parameter is the kind's own, and the fallbacks for raw outputs that lack what a kind needs."""

import numpy as np
import pytest
import torch

from ibedl.core.head import HeadConfig, build_head
from ibedl.training.head_kinds import KINDS, head_kind, served_kind


def raw_of(kind: str, n: int = 40, seed: int = 0) -> tuple[dict, np.ndarray]:
    """Raw outputs of a real head of ``kind`` on random hidden states (3-5 options), and labels."""
    torch.manual_seed(seed)
    head = build_head(HeadConfig(kind, 5, 8), torch.randn(5, 8) * 2)
    counts = np.random.default_rng(seed).integers(3, 6, n)
    mask = torch.arange(5)[None, :] < torch.as_tensor(counts)[:, None]
    with torch.no_grad():
        out = head(torch.randn(n, 8), mask)
    rows = lambda t: [t[i, :c].double().numpy() for i, c in enumerate(counts)]  # noqa: E731
    raw = {"probs": rows(out.probs), "offset": 1.0}
    if out.alpha is not None:
        raw["alpha"] = rows(out.alpha)
        raw["sigma"] = rows(out.sigma) if out.sigma is not None else None
    labels = np.asarray([np.random.default_rng(seed + i).integers(0, c) for i, c in enumerate(counts)])
    return raw, labels


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_fitted_step_is_the_kinds_and_both_precisions_agree(kind):
    raw, labels = raw_of(kind)
    method = head_kind(kind)
    update, record = method.fit(raw, labels, np.arange(len(labels)))
    assert set(update) == ({method.key} if method.key else set())
    assert record["kind"] == method.key
    calibrated, served = method.outputs(raw, update), method.served(raw, update)
    for a, b in zip(calibrated.probs, served.probs, strict=True):
        assert np.allclose(a, b, atol=1e-5) and abs(a.sum() - 1) < 1e-9
    assert (calibrated.uncertainty is None) == (kind == "softmax")
    neutral = method.outputs(raw, method.neutral())
    assert all(np.allclose(p, q) for p, q in zip(neutral.probs, method.outputs(raw, {}).probs, strict=True))


def test_raw_outputs_without_what_a_kind_needs_fall_back():
    raw, _ = raw_of("ib_edl")
    assert served_kind("ib_edl", raw) == "ib_edl"
    assert served_kind("ib_edl", {**raw, "sigma": None}) == "evidential"
    assert served_kind("evidential", {"probs": raw["probs"], "offset": 1.0}) == "softmax"  # an averaged ensemble
    with pytest.raises(ValueError, match="unknown head kind 'gaussian'"):
        head_kind("gaussian")
