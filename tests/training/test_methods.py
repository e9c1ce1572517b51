"""Every registered method: its loss is finite, differentiable and matches its head; one registry line each."""

import pytest
import torch

from evidential.head import HeadConfig, build_head
from training.methods import METHODS, LossContext, get_method


@pytest.mark.parametrize("name", sorted(METHODS))
def test_loss_is_finite_and_trains_the_head(name):
    method = get_method(name)
    params = method.params()
    torch.manual_seed(0)
    rows = torch.randn(5, 16)
    head = build_head(HeadConfig(method.head, 5, 16, offset=method.offset(params)), rows)
    hidden = torch.randn(6, 16)
    mask = torch.ones(6, 4, dtype=torch.bool)
    mask[0, 3] = False  # a 3-option question in the batch
    y = torch.tensor([2, 0, 1, 3, 3, 0])
    out = head(hidden, mask)
    parts = method.loss(out, y, mask, params, LossContext(progress=0.5, generator=torch.Generator().manual_seed(0)))
    assert parts["loss"].shape == (6,)
    assert torch.isfinite(parts["loss"]).all()
    parts["loss"].mean().backward()
    grads = [p.grad for p in head.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert (out.uncertainty is not None) == method.dirichlet


def test_r_edl_uses_eta_offset():
    method = get_method("r_edl")
    assert method.offset(method.params()) == 0.1
    assert method.offset(method.params({"eta": 0.5})) == 0.5


def test_unknown_method_names_known_ones():
    with pytest.raises(ValueError, match="unknown method 'nope'; known: .*ib_edl"):
        get_method("nope")
