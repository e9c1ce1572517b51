import numpy as np
import pytest
import torch

from benchmarks.posthoc_repair import TAU_GRID, fit, outputs, repaired
from ibedl.core.head import adjust_alpha


def test_the_step_is_zetas_map_then_evidence_divided_by_tau():
    rng = np.random.default_rng(0)
    alpha, sigma = 1 + rng.gamma(2, 3, (50, 4)), rng.gamma(1, 1, (50, 4))
    for zeta in (-2.0, 3.0):  # 3: some entries clipped at the floor
        shifted = adjust_alpha(torch.as_tensor(alpha), torch.as_tensor(sigma), zeta, 1.0).numpy()
        assert np.allclose(repaired(alpha, sigma, zeta, 1.0), shifted)
    assert (repaired(alpha, sigma, 3.0, 1.0) == 1.0).any()
    assert np.allclose(repaired(alpha, sigma, 0.0, 2.0) - 1, (alpha - 1) / 2)
    with pytest.raises(ValueError, match="tau must be > 0, got 0"):
        repaired(alpha, sigma, 0.0, 0)


def test_tau_keeps_the_order_of_u_among_questions_with_the_same_options():
    rng = np.random.default_rng(1)
    alpha, sigma = 1 + rng.gamma(2, 3, (200, 4)), np.zeros((200, 4))
    _, u = outputs(repaired(alpha, sigma, 0.0, 1.0))
    _, u_tau = outputs(repaired(alpha, sigma, 0.0, 2.5))
    assert (np.argsort(u) == np.argsort(u_tau)).all() and (u_tau > u).all()


def test_the_fit_recovers_a_known_evidence_temperature():
    """Labels drawn from Dirichlet means whose evidence was then doubled: tau near 2 undoes it."""
    rng = np.random.default_rng(2)
    evidence = rng.gamma(0.6, 4, (4000, 4))
    true = (1 + evidence) / (1 + evidence).sum(1, keepdims=True)
    labels = np.array([rng.choice(4, p=p) for p in true])
    zeta, tau, _ = fit(1 + 2 * evidence, np.zeros((4000, 4)), labels, (0.0,), TAU_GRID)
    assert zeta == 0.0 and tau == pytest.approx(2.0, rel=0.15)


def test_answers_made_on_other_weights_or_another_calibration_are_refused(tiny_artifact, tiny_map_artifact, tmp_path,
                                                                         capsys):
    """The fresh sample's answers record what each adapter answered with (paired_bootstrap --save-answers: weights,
    served sections, the calibration of the backend it ran on); answers that no longer match are stale, refused."""
    import json
    import shutil

    from benchmarks.paired_bootstrap import adapter_identity
    from benchmarks.posthoc_repair import main
    from ibedl.core.artifact import read_manifest
    from ibedl.training.calibrate import weights_sha256

    default, twin = tmp_path / "default", tmp_path / "twin"
    shutil.copytree(tiny_artifact, default)
    shutil.copytree(tiny_map_artifact, twin)
    scores = tmp_path / "scores.json"
    scores.write_text(json.dumps({"weights_sha256": weights_sha256(default, read_manifest(default))}))
    key = read_manifest(twin).calibrated_on
    identity = {str(default): adapter_identity(default, key), str(twin): adapter_identity(twin, key)}
    assert identity[str(twin)]["posthoc"] == read_manifest(twin).calibration_for(key).head
    with pytest.raises(ValueError, match="no calibration made on 'openvino-int8'"):
        adapter_identity(twin, "openvino-int8")
    fresh = tmp_path / "fresh.json"
    argv = ["--scores", str(scores), "--fresh", str(fresh), "--artifact", str(default), "--twin", str(twin),
            "--output", str(tmp_path / "out.json")]

    def refused(adapters: dict | None) -> str:
        fresh.write_text(json.dumps({"labels": [], "answers": {str(default): {}, str(twin): {}},
                                     **({"adapters": adapters} if adapters is not None else {})}))
        assert main(argv) == 2 and not (tmp_path / "out.json").exists()
        return capsys.readouterr().err

    assert "no record of what" in refused(None)  # answers saved before they recorded their adapters
    other_key = {**identity, str(twin): {**identity[str(twin)], "calibration_key": "openvino-int8"}}
    assert "cannot be checked" in refused(other_key)  # made under a calibration the twin does not carry
    other_t = {**identity, str(twin): {**identity[str(twin)], "posthoc": {"temperature": 9.0}}}
    assert f"{twin} has changed since its answers (posthoc)" in refused(other_t)
    manifest = json.loads((twin / "manifest.json").read_text())
    manifest["head"]["quadrature_points"] = 8  # another served setting, the weights and calibration unchanged
    (twin / "manifest.json").write_text(json.dumps(manifest))
    assert "(served_sha256)" in refused(identity)
    identity[str(twin)] = adapter_identity(twin, key)
    head = default / "head.safetensors"
    head.write_bytes(head.read_bytes() + b" ")  # other weights: the default's sha256 moves
    scores.write_text(json.dumps({"weights_sha256": weights_sha256(default, read_manifest(default))}))
    assert f"{default} has changed since its answers (weights_sha256)" in refused(identity)
