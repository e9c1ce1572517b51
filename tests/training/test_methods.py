"""Every registered method: its loss is finite, differentiable and matches its head; one registry line each."""

import pytest
import torch

from ibedl.core.head import HeadConfig, build_head
from ibedl.training.methods import METHODS, LossContext, get_method


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
    assert (out.uncertainty is not None) == (method.head != "softmax")  # Dirichlet heads give u


def test_r_edl_uses_eta_offset():
    method = get_method("r_edl")
    assert method.offset(method.params()) == 0.1
    assert method.offset(method.params({"eta": 0.5})) == 0.5


def test_unknown_method_names_known_ones():
    with pytest.raises(ValueError, match="unknown method 'nope'; known: .*ib_edl"):
        get_method("nope")


def _ib_edl_parts(params, progress):
    method = get_method("ib_edl")
    torch.manual_seed(0)
    head = build_head(HeadConfig("ib_edl", 4, 16), torch.randn(4, 16))
    mask = torch.ones(3, 4, dtype=torch.bool)
    out = head(torch.randn(3, 16), mask)
    ctx = LossContext(progress=progress, generator=torch.Generator().manual_seed(1))
    return method.loss(out, torch.tensor([0, 1, 2]), mask, method.params(params), ctx)


@pytest.mark.parametrize("progress, expected", [
    (0.0, 1e-3), (0.25, 1e-4), (0.5, 1e-5), (0.9, 1e-5), (1.0, 1e-5),  # log-linear over the first half
])
def test_ib_edl_beta_anneals_log_linearly_then_stays(progress, expected):
    parts = _ib_edl_parts({"beta": 1e-5, "beta_start": 1e-3, "beta_anneal": 0.5}, progress)
    assert parts["beta"][0].item() == pytest.approx(expected, rel=1e-6)
    torch.testing.assert_close(parts["loss"], parts["risk"] + expected * parts["info"])


@pytest.mark.parametrize("progress", [0.0, 0.7])
def test_ib_edl_beta_is_constant_without_beta_start(progress):
    parts = _ib_edl_parts({"beta": 2e-4}, progress)
    assert parts["beta"][0].item() == pytest.approx(2e-4)
    torch.testing.assert_close(parts["loss"], parts["risk"] + 2e-4 * parts["info"])


@pytest.mark.parametrize("params, message", [
    ({"beta": -1e-3}, "beta must be a finite number >= 0, got -0.001"),
    ({"beta": float("nan")}, "beta must be a finite number >= 0, got nan"),
    ({"beta": "1e-3"}, "beta must be a finite number >= 0, got '1e-3'"),
    ({"num_samples": 0}, "num_samples must be an integer >= 1, got 0"),
    ({"risk": "hinge"}, "risk must be 'mse' or 'nll', got 'hinge'"),
    ({"beta_start": 0.0}, "beta_start must be a finite number > 0 .*got 0.0"),
    ({"beta_start": 1e-3, "beta": 0.0}, "beta_start needs beta > 0"),
    ({"beta_anneal": 0.0}, r"beta_anneal must be a finite number in \(0, 1\], got 0.0"),
    ({"beta_anneal": 1.5}, r"beta_anneal must be a finite number in \(0, 1\], got 1.5"),
])
def test_ib_edl_rejects_bad_hyper_parameters_on_arrival(params, message):
    with pytest.raises(ValueError, match=message):
        get_method("ib_edl").params(params)


@pytest.mark.parametrize("name", ["edl", "i_edl", "r_edl"])
def test_edl_family_kl_weight_follows_the_epoch(name):
    method = get_method(name)
    torch.manual_seed(0)
    head = build_head(HeadConfig("evidential", 4, 16), torch.randn(4, 16))
    mask = torch.ones(3, 4, dtype=torch.bool)
    out, y = head(torch.randn(3, 16), mask), torch.tensor([0, 1, 2])
    params = method.params()

    def loss(epoch):
        return method.loss(out, y, mask, params, LossContext(epoch=epoch, epochs=4))

    first, third = loss(0), loss(2)
    assert (first["kl"] > 0).all()
    torch.testing.assert_close(first["loss"] - third["loss"], -0.5 * params["kl_weight"] * third["kl"])


def test_ib_edl_sigma_constant_replaces_the_learned_sigma_in_the_loss():
    method = get_method("ib_edl")
    torch.manual_seed(0)
    head = build_head(HeadConfig("ib_edl", 4, 16), torch.randn(4, 16))
    mask = torch.ones(3, 4, dtype=torch.bool)
    out, y = head(torch.randn(3, 16), mask), torch.tensor([0, 1, 2])
    params = method.params({"sigma_constant": 0.5, "beta": 1e-2})
    parts = method.loss(out, y, mask, params, LossContext(generator=torch.Generator().manual_seed(3)))
    # KL(N(mu, 0.25) || N(0, 1)) per option, summed: 0.5 (mu^2 + 0.25 - 2 log 0.5 - 1)
    expected = 0.5 * (out.logits**2 + 0.25 - 2 * torch.log(torch.tensor(0.5)) - 1).sum(-1)
    torch.testing.assert_close(parts["info"], expected)
    parts["loss"].sum().backward()
    assert head.sigma_weight.grad is None and head.mu_weight.grad is not None
    with pytest.raises(ValueError, match="sigma_constant must be a finite number > 0 .* got -1"):
        method.params({"sigma_constant": -1})


def test_a_new_method_is_one_module_and_one_registry_line(monkeypatch):
    """What a contributor writes: a Method record (here a Brier-score softmax objective) and its registry line; the
    config, the benchmark grid and the calibration step reach it through the registry with no other edit."""
    from ibedl.training.config import TrainConfig
    from ibedl.training.experiments.benchmark import expand
    from ibedl.training.head_kinds import head_kind
    from ibedl.training.methods import Method

    def brier(out, y, mask, params, ctx):
        onehot = torch.nn.functional.one_hot(y, out.probs.shape[1]).float()
        return {"loss": ((out.probs - onehot) ** 2 * mask).sum(1)}

    monkeypatch.setitem(METHODS, "brier", Method(name="brier", head="softmax", loss=brier, label="Brier"))
    config = TrainConfig.model_validate({"method": "brier", "data": {"train": [{"dataset": "sciq"}],
                                                                      "validation": [{"dataset": "sciq"}]},
                                         "output": "runs/x"})
    assert get_method(config.method).label == "Brier"
    grid = expand({"methods": ["map", "brier"], "seeds": [0], "experiments": [{"kind": "id", "datasets": ["sciq"]}]})
    assert [r.method for r in grid] == ["map", "brier"]
    assert head_kind(get_method("brier").head).key == "temperature"  # its post-hoc step: its head kind's


def test_ib_edl_sigma_frozen_keeps_the_sigma_head_out_of_the_optimizer():
    from types import SimpleNamespace

    from ibedl.training.finetune import make_optimizer

    head = build_head(HeadConfig("ib_edl", 5, 16), torch.randn(5, 16))
    model = torch.nn.Linear(2, 2)
    for params, trained in (({"sigma_frozen": True}, {"mu_weight"}),
                            ({"sigma_constant": 0.5}, {"mu_weight"}),  # the loss never reads the sigma head
                            ({}, {"mu_weight", "sigma_weight", "sigma_bias"})):
        for p in head.parameters():
            p.requires_grad_(True)
        cfg = SimpleNamespace(method="ib_edl", method_params=params, train_evidence_bias=False,
                              optim=SimpleNamespace(lr=1e-3, head_lr=None, weight_decay=0.0))
        optimizer, _ = make_optimizer(cfg, model, head)
        in_optimizer = {id(p) for p in optimizer.param_groups[1]["params"]}
        assert {n for n, p in head.named_parameters() if id(p) in in_optimizer} == trained
    with pytest.raises(ValueError, match="sigma_frozen"):
        get_method("ib_edl").params({"sigma_frozen": "yes"})


def test_ib_edl_sigma_lr_scale_trains_the_sigma_head_at_its_own_rate():
    from types import SimpleNamespace

    from ibedl.training.finetune import make_optimizer

    head = build_head(HeadConfig("ib_edl", 5, 16), torch.randn(5, 16))
    model = torch.nn.Linear(2, 2)
    cfg = SimpleNamespace(method="ib_edl", method_params={"sigma_lr_scale": 20}, train_evidence_bias=True,
                          optim=SimpleNamespace(lr=1e-3, head_lr=5e-5, weight_decay=0.0))
    optimizer, count = make_optimizer(cfg, model, head)
    names = {id(p): n for n, p in head.named_parameters()}
    groups = {tuple(sorted(names[id(p)] for p in g["params"])): g["lr"] for g in optimizer.param_groups[1:]}
    assert groups == {("mu_bias", "mu_weight"): 5e-5, ("sigma_bias", "sigma_weight"): pytest.approx(1e-3)}
    assert count == sum(p.numel() for p in model.parameters()) + sum(p.numel() for p in head.parameters())
    cfg.method_params = {}  # the default: one head group at head_lr
    optimizer, _ = make_optimizer(cfg, model, head)
    assert [g["lr"] for g in optimizer.param_groups[1:]] == [5e-5]
    with pytest.raises(ValueError, match="sigma_lr_scale"):
        get_method("ib_edl").params({"sigma_lr_scale": 0})


def test_ib_edl_sigma_init_scale_zero_starts_sigma_equal_for_every_question():
    """Scale 0: the sigma rows start at zero, so after the first batch's centring sigma is softplus(0) + floor for
    every question and option; scale 1 (the paper's) makes it vary with the hidden state."""
    from ibedl.core.head import SIGMA_FLOOR

    method = get_method("ib_edl")
    rows, hidden = torch.randn(4, 16), torch.randn(6, 16)
    mask = torch.ones(6, 4, dtype=torch.bool)
    for scale, constant in ((0, True), (1, False)):
        options = method.head_options(method.params({"sigma_init_scale": scale}))
        head = build_head(HeadConfig("ib_edl", 4, 16, centre_options=True, centre_sigma=True, **options), rows)
        head.init_bias_from(hidden, mask)
        _, sigma = head.gaussian(hidden, mask)
        expected = torch.nn.functional.softplus(torch.zeros(())) + SIGMA_FLOOR
        assert torch.allclose(sigma, expected.expand_as(sigma)) == constant


def test_ib_edl_inference_reaches_the_head_it_trains():
    method = get_method("ib_edl")
    assert method.head_options(method.params({}))["inference"] == "mean"  # the default answers as before
    options = method.head_options(method.params({"inference": "sampled", "inference_samples": 7}))
    config = HeadConfig("ib_edl", 4, 16, **options)
    assert (config.inference, config.inference_samples) == ("sampled", 7)
    with pytest.raises(ValueError, match="inference_samples"):
        method.params({"inference_samples": 0})
