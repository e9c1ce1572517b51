"""ibedl.training.calibrate: the gate's quantile, temperature fitting, the sections it writes, and the CLI."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.stats import binom

from ibedl.core.artifact import Abstention, Conformal, check_artifact, read_manifest
from ibedl.core.head import temper as torch_temper
from ibedl.core.model_card import num
from ibedl.training.calibrate import (
    CalibrationConfig,
    calibrate_outputs,
    gate_threshold,
    main,
    next_version,
    posthoc_outputs,
    read_outputs,
    save_outputs,
    split,
)
from ibedl.training.head_kinds import fit_temperature, fit_zeta, temper


class TestGate:
    def test_threshold_is_the_kth_smallest(self):
        scores = np.arange(1.0, 101.0)  # n = 100, rate 0.05 -> k = floor(0.05 * 101) = 5
        assert gate_threshold(scores, 0.05) == 5.0
        assert gate_threshold(scores, 0.0) == 0.0  # k = 0: no gate

    def test_false_rejection_rate_on_exchangeable_data(self):
        """Fresh in-distribution scores fall below the threshold k/(n+1) <= rate of the time, on average."""
        rng = np.random.default_rng(0)
        rates = []
        for _ in range(400):
            t = gate_threshold(rng.normal(size=300), 0.05)
            rates.append(np.mean(rng.normal(size=2000) < t))
        expected = np.floor(0.05 * 301) / 301
        assert np.mean(rates) == pytest.approx(expected, abs=0.004)
        assert np.mean(rates) <= 0.05 + 0.004


    def test_training_conditional_threshold_is_the_largest_rank_the_binomial_tail_allows(self):
        scores = np.arange(1.0, 301.0)  # n = 300, rate 0.15, delta 0.01
        k = max(k for k in range(1, 301) if binom.cdf(k - 1, 300, 0.15) <= 0.01)
        assert gate_threshold(scores, 0.15, 0.01) == float(k) and 25 < k < 45 <= np.floor(0.15 * 301)
        assert gate_threshold(np.arange(1.0, 11.0), 0.05, 0.01) == 0.0  # too few scores for any gate

    def test_the_served_gate_refuses_at_most_the_rate_with_probability_one_minus_delta(self):
        """Over 2,000 draws of 300 in-distribution scores, the refusal rate of the served threshold (exact: the
        normal CDF at it) exceeds 15% in at most delta = 5% of draws (binomial margin), where the marginal rule's
        does so in about half of them."""
        from scipy.stats import norm

        rng = np.random.default_rng(3)
        pac = np.array([norm.cdf(gate_threshold(rng.normal(size=300), 0.15, 0.05)) for _ in range(2000)])
        marginal = np.array([norm.cdf(gate_threshold(rng.normal(size=300), 0.15)) for _ in range(2000)])
        assert np.mean(pac > 0.15) <= 0.05 + 3 * np.sqrt(0.05 * 0.95 / 2000)
        assert 0.3 < np.mean(marginal > 0.15) < 0.7


class TestTemperature:
    def test_recovers_the_temperature_that_generated_the_labels(self):
        rng = np.random.default_rng(0)
        true_t = 2.5
        probs, labels = [], []
        for _ in range(4000):
            z = rng.normal(scale=3.0, size=int(rng.integers(2, 6)))
            p = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
            q = np.exp(z / true_t - (z / true_t).max())
            labels.append(int(rng.choice(len(z), p=q / q.sum())))
            probs.append(p)
        t, info = fit_temperature(probs, labels)
        assert t == pytest.approx(true_t, rel=0.1)
        assert info["nll_at_temperature"] < info["nll_at_1"]

    def test_numpy_and_torch_temper_give_the_known_answer(self):
        # T = 2 is softmax(log p / 2) = sqrt(p) / sum(sqrt(p)), by hand: sqrt([0.81, 0.09, 0.1]) = [0.9, 0.3,
        # 0.316227766...], sum 1.516227766..., so [0.5935784, 0.1978595, 0.2085622]; uniform stays uniform.
        expected = [0.9 / 1.5162277660168379, 0.3 / 1.5162277660168379, 0.31622776601683794 / 1.5162277660168379]
        assert expected == pytest.approx([0.5935784, 0.1978595, 0.2085622], abs=1e-7)
        probs = torch.tensor([[0.81, 0.09, 0.1, 0.0], [0.25, 0.25, 0.25, 0.25]])
        mask = torch.tensor([[True, True, True, False], [True] * 4])
        out = torch_temper(probs, mask, 2.0)
        assert out[0, 3] == 0
        assert out[0, :3].numpy() == pytest.approx(expected, abs=1e-6)
        assert out[1].numpy() == pytest.approx([0.25] * 4, abs=1e-7)
        assert temper([np.array([0.81, 0.09, 0.1])], 2.0)[0] == pytest.approx(expected, abs=1e-12)


class TestPosthocOutputs:
    """calibrate applies the heads' own maps (ibedl.core.head) to raw outputs: closed-form cases."""

    def test_zeta_closed_form(self):
        raw = {"alpha": [[3.0, 1.5], [2.0, 1.2, 1.1]], "sigma": [[1.0, 0.25], [0.5, 0.5, 0.5]], "offset": 1.0,
               "probs": [[2 / 3, 1 / 3], [0.5, 0.3, 0.2]]}
        out = posthoc_outputs("ib_edl", raw, {"zeta": 1.0})
        # alpha -> max(alpha - sigma, 1): [2, 1.25] and [1.5, 1, 1]; u = C * offset / alpha0.
        assert out.probs[0].tolist() == pytest.approx([2 / 3.25, 1.25 / 3.25])
        assert out.probs[1].tolist() == pytest.approx([1.5 / 3.5, 1 / 3.5, 1 / 3.5])
        assert out.uncertainty.tolist() == pytest.approx([2 / 3.25, 3 / 3.5])
        neutral = posthoc_outputs("ib_edl", raw, {})
        assert neutral.probs[0].tolist() == pytest.approx([3 / 4.5, 1.5 / 4.5])

    def test_temperature_closed_form(self):
        raw = {"probs": [[0.64, 0.16, 0.2], [0.81, 0.09]], "offset": 1.0}
        out = posthoc_outputs("softmax", raw, {"temperature": 2.0})  # T = 2: sqrt(p) normalised
        assert out.probs[0].tolist() == pytest.approx([0.8 / 1.6472135955, 0.4 / 1.6472135955, 0.4472135955 /
                                                      1.6472135955])
        assert out.probs[1].tolist() == pytest.approx([0.75, 0.25]) and out.uncertainty is None

    def test_fitted_zeta_minimises_nll_through_the_head_map(self):
        # One question, label 1, sigma only on the wrong option: the largest zeta on the grid wins until the
        # wrong option's alpha hits the floor (alpha 3 - zeta * 0.5 >= 1 up to zeta 4, flat after).
        zeta, info = fit_zeta([np.array([3.0, 2.0])], [np.array([0.5, 0.0])], [1])
        assert zeta == 4.0 and info["nll_at_zeta"] == pytest.approx(-np.log(2 / 3))
        assert info["nll_at_0"] == pytest.approx(-np.log(2 / 5))


def _synthetic(kind: str, n: int = 600, seed: int = 0):
    rng = np.random.default_rng(seed)
    raw = {"probs": [], "alpha": [], "sigma": [], "offset": 1.0}
    labels = []
    for _ in range(n):
        c = int(rng.integers(2, 6))
        y = int(rng.integers(c))
        alpha = 1.0 + rng.gamma(1.0, 2.0, size=c)
        alpha[y] += rng.gamma(3.0, 4.0)
        raw["alpha"].append(list(alpha))
        raw["sigma"].append(list(rng.uniform(0.01, 0.3, size=c)))
        raw["probs"].append(list(alpha / alpha.sum()))
        labels.append(y)
    if kind == "softmax":
        raw.pop("alpha"), raw.pop("sigma")
    if kind == "evidential":
        raw.pop("sigma")
    return raw, labels


def reference_outputs(kind: str, raw: dict, head_update: dict) -> tuple[list[np.ndarray], np.ndarray]:
    """Per-question probabilities and (N,) OOD scores straight from the heads' definitions (see the caller)."""
    probs, ood = [], []
    for i in range(len(raw["probs"])):
        if kind == "softmax":
            p = np.asarray(raw["probs"][i], dtype=np.float64) ** (1.0 / head_update.get("temperature", 1.0))
            probs.append(p / p.sum())
            ood.append(probs[-1].max())
            continue
        alpha = np.asarray(raw["alpha"][i], dtype=np.float64)
        if kind == "ib_edl":
            alpha = np.maximum(alpha - head_update.get("zeta", 0.0) * np.asarray(raw["sigma"][i]), raw["offset"])
        probs.append(alpha / alpha.sum())
        ood.append(alpha.sum() / (len(alpha) * raw["offset"]))
    return probs, np.asarray(ood)


class TestCalibrateOutputs:
    @pytest.mark.parametrize("kind", ["ib_edl", "evidential", "softmax"])
    def test_sections_are_valid_and_consistent(self, kind):
        raw, labels = _synthetic(kind)
        config = CalibrationConfig(target_accuracy=0.8, delta=0.1, min_per_count=100)
        head_update, outputs, sections = calibrate_outputs(kind, raw, labels, config)
        assert set(head_update) <= {"zeta", "temperature"}
        abst = Abstention(**sections["abstention"])
        conformal = Conformal(**sections["conformal"])
        cal = sections["calibration"]
        assert cal["n_fit"] == 180 and cal["n_calibration"] == 420
        assert abst.ood_score == ("max_probability" if kind == "softmax" else "inverse_uncertainty")
        # The post-hoc outputs, recomputed here from the heads' definitions rather than by the code under test:
        # IB-EDL alpha -> max(alpha - zeta * sigma, offset), p = alpha / alpha0, u = C * offset / alpha0, OOD score
        # 1 / u; evidential the same without the map; softmax p -> p^(1/T) / sum p^(1/T), OOD score max p.
        probs, ood = reference_outputs(kind, raw, head_update)
        assert np.allclose(np.concatenate(outputs.probs), np.concatenate(probs), rtol=1e-12, atol=1e-12)
        assert np.allclose(outputs.ood_score(), ood, rtol=1e-12, atol=0)
        # 2..5 options, about 150 questions each (min_per_count 100): calibrated per count. Each count's gate is the
        # k-th smallest OOD score of its questions in the fit part, k the largest with P(Binomial(n_fit_c, 0.05) <=
        # k - 1) <= delta (training-conditional); its quantiles rest on its questions in the calibration part; the
        # top level is the most common count's.
        fit, cal_idx = split(600, 0.3, 0)
        counts = np.asarray([len(p) for p in raw["probs"]])
        assert cal["option_counts"] == [2, 3, 4, 5] == sorted(map(int, abst.by_options))
        for c in (2, 3, 4, 5):
            fit_c, cal_c = fit[counts[fit] == c], cal_idx[counts[cal_idx] == c]
            k = max((k for k in range(1, len(fit_c) + 1) if binom.cdf(k - 1, len(fit_c), 0.05) <= 0.1), default=0)
            mine = abst.for_options(c)
            assert mine.ood_threshold == (pytest.approx(np.sort(ood[fit_c])[k - 1], rel=1e-12) if k else 0.0)
            assert conformal.for_options(c).n == len(cal_c) == cal["by_options"][str(c)]["risk_control"]["n"] + \
                int(np.sum(ood[cal_c] < mine.ood_threshold))  # LTT sees the questions the gate lets through
            risk = cal["by_options"][str(c)]["risk_control"]
            assert mine.min_confidence == risk["min_confidence"] and mine.how["n"] == len(cal_c)
            assert not risk["certified"] or risk["accuracy_lower_bound"] >= 0.8 - 1e-12
        main = max((2, 3, 4, 5), key=lambda c: (int(np.sum(counts == c)), -c))
        assert abst.ood_threshold == abst.for_options(main).ood_threshold
        assert conformal.n == conformal.for_options(main).n
        assert abst.for_options(7) is abst  # a count never calibrated: the top level (answers say no guarantee holds)
        assert sorted(conformal.alphas()) == [0.01, 0.02, 0.05, 0.1, 0.2] and conformal.delta == 0.1
        assert len(sections["reference"]["confidence"]) == int(np.sum(counts == main))  # drift: the main count

    def test_the_top_level_is_the_traffics_usual_count_when_named(self):
        raw, labels = _synthetic("ib_edl", n=600)  # 2..5 options, about 150 each
        counts = np.asarray([len(p) for p in raw["probs"]])
        config = CalibrationConfig(target_accuracy=0.8, main_options=4, min_per_count=100)
        _, _, sections = calibrate_outputs("ib_edl", raw, labels, config)
        abst, conformal = Abstention(**sections["abstention"]), Conformal(**sections["conformal"])
        assert abst.ood_threshold == abst.for_options(4).ood_threshold and conformal.n == conformal.for_options(4).n
        assert abst.min_confidence == abst.for_options(4).min_confidence
        assert len(sections["reference"]["confidence"]) == int(np.sum(counts == 4))
        with pytest.raises(ValueError, match=r"main_options 6 is not a count calibrated here \(\[2, 3, 4, 5\]\)"):
            calibrate_outputs("ib_edl", raw, labels, CalibrationConfig(target_accuracy=0.8, main_options=6,
                                                                       min_per_count=100))

    def test_a_sample_with_few_questions_per_count_is_calibrated_once_and_claims_none(self):
        raw, labels = _synthetic("ib_edl", n=300)  # about 75 per count: fewer than MIN_PER_COUNT (200)
        _, outputs, sections = calibrate_outputs("ib_edl", raw, labels, CalibrationConfig(target_accuracy=0.8))
        abst, cal = Abstention(**sections["abstention"]), sections["calibration"]
        assert abst.by_options == {} and "by_options" not in cal and cal["option_counts"] == []
        # the gate is the k-th smallest OOD score of the whole fit part, k the largest with P(Binomial(90, 0.05) <=
        # k - 1) <= 0.01: 0.95^90 = 0.0099 passes at k = 1, P(<= 1) = 0.058 does not at k = 2
        fit, _ = split(300, 0.3, 0)
        assert binom.cdf(0, 90, 0.05) <= 0.01 < binom.cdf(1, 90, 0.05)
        assert abst.ood_threshold == pytest.approx(np.sort(outputs.ood_score()[fit])[1 - 1], rel=1e-12)
        assert cal["risk_control"]["delta"] == 0.01 and sections["conformal"]["delta"] == 0.01
        assert len(sections["reference"]["confidence"]) == 300

    def test_a_count_is_claimed_only_with_enough_questions_of_it(self, caplog):
        """Five 6-option questions beside 600 of 2..5 options: the 6 is not claimed (its answers say no promise
        holds), the others are, each on its own questions."""
        raw, labels = _synthetic("ib_edl", n=600)
        rng = np.random.default_rng(9)
        for _ in range(5):
            alpha = list(1.0 + rng.gamma(1.0, 2.0, size=6))
            raw["alpha"].append(alpha), raw["sigma"].append([0.1] * 6), raw["probs"].append(
                list(np.asarray(alpha) / sum(alpha)))
            labels.append(0)
        with caplog.at_level("WARNING", logger="ibedl.training.calibrate"):
            _, _, sections = calibrate_outputs("ib_edl", raw, labels, CalibrationConfig(target_accuracy=0.8,
                                                                                        min_per_count=100))
        assert sections["calibration"]["option_counts"] == [2, 3, 4, 5]
        assert sorted(map(int, sections["abstention"]["by_options"])) == [2, 3, 4, 5]
        assert "option counts [6] have fewer than 100 questions each (6: 5): not claimed" in caplog.text
        with pytest.raises(ValueError, match="min_per_count must be an integer >= 1, got 0"):
            CalibrationConfig(min_per_count=0)

    def test_per_count_the_post_hoc_parameter_is_fitted_on_the_traffic_s_usual_count(self):
        """One zeta serves every count; it is fitted on the main count's fit questions (the others' thresholds and
        sets are chosen after it, on their own questions)."""
        from ibedl.training.head_kinds import head_kind

        raw, labels = _synthetic("ib_edl", n=600)
        config = CalibrationConfig(target_accuracy=0.8, main_options=4, min_per_count=100)
        head_update, _, sections = calibrate_outputs("ib_edl", raw, labels, config)
        fit, _ = split(600, 0.3, 0)
        counts = np.asarray([len(p) for p in raw["probs"]])
        expected, _ = head_kind("ib_edl").fit(raw, np.asarray(labels), fit[counts[fit] == 4])
        assert head_update == expected and sections["calibration"]["posthoc"]["fitted_on_options"] == 4
        assert sections["reference"]["options"] == 4  # drift watches the main count's answers against these
        ref = np.asarray(sections["reference"]["confidence"])
        assert len(ref) == min(CalibrationConfig().reference_size, int((counts == 4).sum())) and ref.min() >= 0.25

    def test_a_single_count_is_claimed_when_it_has_enough_questions(self):
        raw, labels = _synthetic("ib_edl", n=2000)
        keep = [i for i, p in enumerate(raw["probs"]) if len(p) == 4]  # about 500 four-option questions
        one = {k: ([v[i] for i in keep] if isinstance(v, list) else v) for k, v in raw.items()}
        ys = [labels[i] for i in keep]
        sections = calibrate_outputs("ib_edl", one, ys, CalibrationConfig())[2]
        assert sections["calibration"]["option_counts"] == [4] and sections["reference"]["options"] == 4
        assert calibrate_outputs("ib_edl", raw, labels, CalibrationConfig(min_per_count=10_000))[2]["reference"][
            "options"] is None  # a mixture of counts, none claimed: the reference holds every count
        few = {k: (v[:150] if isinstance(v, list) else v) for k, v in one.items()}
        assert calibrate_outputs("ib_edl", few, ys[:150], CalibrationConfig())[2]["calibration"][
            "option_counts"] == []

    def test_no_posthoc_sets_the_parameter_neutral(self):
        raw, labels = _synthetic("ib_edl")
        head_update, _, sections = calibrate_outputs("ib_edl", raw, labels, CalibrationConfig(posthoc=False))
        assert head_update == {"zeta": 0.0} and sections["calibration"]["posthoc"] == {"kind": None}

    @pytest.mark.parametrize("kwargs, match", [
        ({"target_accuracy": 1.0}, "target_accuracy"), ({"delta": 0}, "delta"), ({"alpha": 1.5}, "alpha"),
        ({"score": "raps"}, "score"), ({"ood_rejection_rate": 1.0}, "ood_rejection_rate"),
        ({"fit_fraction": 0.0}, "fit_fraction"), ({"main_options": 1}, r"main_options .* 2\.\.26, got 1"),
        ({"main_options": 27}, "got 27"), ({"main_options": True}, "got True")])
    def test_config_checks_arguments(self, kwargs, match):
        with pytest.raises(ValueError, match=match):
            CalibrationConfig(**kwargs)


def test_stored_outputs_keep_a_confident_models_small_probabilities(tiny_artifact, tmp_path):
    # A confident softmax model: its wrong answers give the right option 1e-9 to 1e-5, which fixed decimals would
    # round to 0 (the MAP twin's temperature moved from 2.279 to 2.337 so). Saved and read back, every float32 value
    # is the same, and so is the temperature fitted on them.
    rng = np.random.default_rng(3)
    labels, probs = [], []
    for _ in range(400):
        y = int(rng.integers(4))
        top = y if rng.random() < 0.85 else (y + 1) % 4
        p = np.full(4, 10.0 ** rng.uniform(-9, -5))
        p[top] = 1.0
        p = (p / p.sum()).astype(np.float32)
        labels.append(y), probs.append([float(x) for x in p])
    manifest = read_manifest(tiny_artifact)
    path = save_outputs(tmp_path / "outputs.json", tiny_artifact, manifest,
                        {"sciq_validation": {"labels": labels, "probs": probs}}, "softmax", 1.0, 1024)
    kind, raw, back = read_outputs(path, "sciq_validation", tiny_artifact, manifest)
    assert kind == "softmax" and back == labels
    np.testing.assert_array_equal(np.asarray(raw["probs"], dtype=np.float32), np.asarray(probs, dtype=np.float32))
    assert min(min(r) for r in raw["probs"]) < 1e-6  # kept, not rounded to 0
    config = CalibrationConfig(target_accuracy=0.5)
    fitted = calibrate_outputs("softmax", raw, labels, config)[0]
    assert fitted == calibrate_outputs("softmax", {"probs": probs, "offset": 1.0}, labels, config)[0]
    assert fitted["temperature"] > 1.0  # over-confident: the fit softens it


def test_sources_decide_which_calibrations_are_dropped():
    """On the committed default (four backends calibrated on SciQ validation): a calibration on other questions
    drops the other backends' and names the top level as stale; the feedback store's labels, a record that names no
    dataset (training's) and a subset of the same split drop nothing."""
    from ibedl.core.artifact import read_manifest
    from ibedl.training.calibrate import calibration_source, drop_other_sources

    def with_record(key, m=None, **record):  # ``key``'s calibration record replaced by ``record``
        m = m or read_manifest(Path(__file__).resolve().parents[2] / "artifacts/default")
        assert m.calibration_keys() == ["torch-fp32", "openvino-fp32", "openvino-bf16", "openvino-int8"]
        if key == m.calibrated_on:
            m.calibration = record
        else:
            m.backend_calibrations[key]["calibration"] = record
        return m

    m = with_record("openvino-int8", dataset="jsonl", path="mine.jsonl", path_sha256="ab" * 32)
    assert drop_other_sources(m, "openvino-int8") == (["openvino-fp32", "openvino-bf16"], ["torch-fp32"])
    assert m.calibration_keys() == ["torch-fp32", "openvino-int8"]
    m = with_record("torch-fp32", dataset="sciq", split="test")
    assert drop_other_sources(m, "torch-fp32") == (["openvino-fp32", "openvino-bf16", "openvino-int8"], [])
    training = {"dataset": "the run's validation data", "split": "validation"}  # as finetune records it
    for same in ({"dataset": "feedback", "path": "db"}, training,
                 {"dataset": "sciq", "split": "validation", "limit": 300, "seed": 4}):
        m = with_record("openvino-bf16", **same)
        assert drop_other_sources(m, "openvino-bf16") == ([], []) and len(m.calibration_keys()) == 4, same
    assert calibration_source({"dataset": "jsonl", "outputs": "o.json"}) is None  # stored outputs, no file named
    # a file known by its content beside one known only by its path (recorded before): may be the same, kept
    m = with_record("openvino-int8", with_record("openvino-fp32", dataset="jsonl", path="mine.jsonl"),
                    dataset="jsonl", path_sha256="cd" * 32)
    assert drop_other_sources(m, "openvino-int8") == (["openvino-bf16"], ["torch-fp32"])
    # a trained artifact's top level (training's record) is not stale beside a backend calibrated on SciQ
    m = with_record("torch-fp32", **training)
    assert drop_other_sources(m, "openvino-int8") == ([], [])


def test_a_jsonl_calibration_recorded_without_its_content_is_judged_by_the_file_as_it_is(tmp_path):
    from ibedl.core.base_model import sha256_file
    from ibedl.training.calibrate import calibration_source

    week1 = tmp_path / "week1.jsonl"
    week1.write_text('{"question": "q", "options": ["a", "b"], "answer": "A"}\n')
    assert calibration_source({"dataset": "jsonl", "path": str(week1)}) == ("jsonl", sha256_file(week1))
    assert calibration_source({"dataset": "jsonl", "path": str(tmp_path / "gone.jsonl")}) == \
        ("jsonl-path", str(tmp_path / "gone.jsonl"))


def test_the_command_for_another_backend_keeps_every_setting_and_runs_the_model():
    from ibedl.core.backends import calibration_key
    from ibedl.training.calibrate import backend_arguments, build_parser, command_on

    parser = build_parser()
    argv = ["--artifact", "a", "--output=b", "--dataset", "feedback", "--path", "postgresql://u:secret@h/db",
            "--target-accuracy", "0.95", "--backend=openvino-int8", "--load-in-4bit", "--option-counts", "2,3,4",
            "--save-o", "s.json", "--dev", "cuda", "--limit", "40", "--seed", "3"]  # abbreviated, as argparse takes
    assert parser.parse_args(argv).save_outputs == "s.json"
    assert command_on(parser, argv, Path("b"), "torch-fp32") == (
        "python -m ibedl.training.calibrate --artifact b --dataset feedback --path postgresql://h/db "
        "--target-accuracy 0.95 --option-counts 2,3,4 --limit 40 --seed 3 --backend torch --device cpu "
        "--dtype float32")
    assert command_on(parser, ["--artifact", "a"], Path("a"), "openvino-int8").endswith(
        "--artifact a --backend openvino-int8 --device cpu")  # an OpenVINO backend runs on the CPU, even beside CUDA
    for key in ("torch-fp32", "torch-bf16", "torch-cuda-fp16", "torch-cuda-nf4-fp32", "torch-cuda-bf16",
                "torch-cuda-nf4-bf16", "openvino-int8", "openvino", "torch-cuda-merged-bf16",
                "torch-cuda-merged-fp32"):  # the arguments compute the key they are for
        args = parser.parse_args(["--artifact", "a", "--dataset", "sciq", *backend_arguments(key)])
        assert calibration_key(args.backend, args.device, args.dtype or "float32", args.load_in_4bit) == key, key
        assert (args.device == "cuda") is ("-cuda-" in key), key  # a CUDA arithmetic is computed on the GPU


@pytest.fixture
def model_never_runs(monkeypatch):
    """Loading the model fails the test: a refusal must come before it (and before minutes of work)."""
    from ibedl.core.predictor import Predictor

    def ran(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were refused")

    monkeypatch.setattr(Predictor, "from_artifact", ran)


def snapshot(directory: Path) -> dict[str, bytes]:
    return {str(f.relative_to(directory)): f.read_bytes() for f in sorted(directory.rglob("*")) if f.is_file()}


class TestRefusedOnArrival:
    """Arguments that cannot work are refused with one line naming them, exit 2, before the model runs."""

    @pytest.fixture
    def common(self, tiny_jsonl):
        return ["--dataset", "jsonl", "--path", str(tiny_jsonl), "--no-progress", "--max-tokens", "96",
                "--min-per-count", "10"]

    def test_an_output_directory_with_files_is_left_untouched(self, tiny_artifact, tiny_map_artifact, common,
                                                             tmp_path, capsys, model_never_runs):
        other = tmp_path / "other"  # another artifact: its weights and manifest would have been replaced
        shutil.copytree(tiny_map_artifact, other)
        before = snapshot(other)
        assert main(["--artifact", str(tiny_artifact), "--output", str(other), *common]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: --output {other} holds files that are not a calibration of {tiny_artifact}")
        assert err.count("\n") == 1
        assert snapshot(other) == before

    def test_an_output_that_is_a_file_is_refused(self, tiny_artifact, common, tmp_path, capsys, model_never_runs):
        file = tmp_path / "notes.txt"
        file.write_text("mine\n")
        assert main(["--artifact", str(tiny_artifact), "--output", str(file), *common]) == 2
        assert capsys.readouterr().err == f"error: --output {file} is a file: name a directory\n"
        assert file.read_text() == "mine\n"

    def test_an_empty_output_directory_or_the_artifact_itself_is_accepted(self, tiny_artifact, common, tmp_path):
        empty = tmp_path / "empty"
        empty.mkdir()
        assert main(["--artifact", str(tiny_artifact), "--output", str(empty), *common]) == 0
        assert read_manifest(empty).version == next_version(read_manifest(tiny_artifact).version)
        # --output naming --artifact (another spelling of it) calibrates in place, as without --output
        assert main(["--artifact", str(empty), "--output", str(empty / ".." / "empty"), *common]) == 0
        assert read_manifest(empty).version == next_version(next_version(read_manifest(tiny_artifact).version))

    def test_an_earlier_output_of_the_same_artifact_is_calibrated_again(self, tiny_artifact, common, tmp_path):
        out = tmp_path / "cal"  # the deploy guide's command, run a second time
        assert main(["--artifact", str(tiny_artifact), "--output", str(out), *common]) == 0
        first = read_manifest(out).version
        assert main(["--artifact", str(tiny_artifact), "--output", str(out), *common, "--target-accuracy", "0.8"]) == 0
        assert read_manifest(out).files == read_manifest(tiny_artifact).files
        # other thresholds: a version past the one written there before (replicas reload only a new version, and
        # labels are counted per version)
        assert read_manifest(out).version == next_version(first)

    @pytest.mark.parametrize("device, says", [("bogus", "not cpu, cuda"), ("tpu", "not cpu, cuda"),
                                              ("cuda", "no CUDA"), ("cuda:1", "no CUDA")])
    def test_a_device_this_machine_lacks(self, tiny_artifact, common, tmp_path, capsys, monkeypatch, device, says,
                                         model_never_runs):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU-only machine, wherever this runs
        assert main(["--artifact", str(tiny_artifact), "--output", str(tmp_path / "out"), "--device", device,
                     *common]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: device {device!r}") and says in err and err.count("\n") == 1
        assert not (tmp_path / "out").exists()

    @pytest.mark.parametrize("where", ["under_a_file", "a_directory"])
    def test_save_outputs_where_no_file_can_be_written(self, tiny_artifact, common, tmp_path, capsys, where,
                                                       model_never_runs):
        (tmp_path / "file").write_text("")
        (tmp_path / "dir").mkdir()
        path = tmp_path / "file" / "y.json" if where == "under_a_file" else tmp_path / "dir"
        assert main(["--artifact", str(tiny_artifact), "--output", str(tmp_path / "out"), "--save-outputs",
                     str(path), *common]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: --save-outputs {path}") and err.count("\n") == 1
        assert ("is a file, not a directory" if where == "under_a_file" else "is a directory: name a file") in err

    @pytest.mark.parametrize("flag", [["--from-seq", "5"], ["--since-change"]])
    def test_feedback_flags_without_the_feedback_dataset(self, tiny_artifact, common, capsys, flag,
                                                         model_never_runs):
        assert main(["--artifact", str(tiny_artifact), *flag, *common]) == 2
        assert capsys.readouterr().err == (f"error: {flag[0]} goes with --dataset feedback (the labels sent back to "
                                           "the service), not --dataset jsonl\n")

    @pytest.mark.parametrize("count", ["0", "27"])
    def test_main_options_outside_the_option_counts(self, tiny_artifact, common, capsys, count, model_never_runs):
        assert main(["--artifact", str(tiny_artifact), "--main-options", count, *common]) == 2
        assert capsys.readouterr().err == f"error: main_options must be an option count in 2..26, got {count}\n"

    def test_an_empty_file_of_questions(self, tiny_artifact, tmp_path, capsys, model_never_runs):
        empty = tmp_path / "empty.jsonl"
        empty.write_text("")
        assert main(["--artifact", str(tiny_artifact), "--dataset", "jsonl", "--path", str(empty),
                     "--output", str(tmp_path / "out")]) == 2
        assert capsys.readouterr().err == f"error: {empty} holds no questions\n"


def test_next_version():
    assert next_version("3") == "4" and next_version("v1") == "v1.recal"


class TestCli:
    def test_bad_argument_fails_before_loading_a_model(self, tiny_artifact, capsys):
        assert main(["--artifact", str(tiny_artifact), "--dataset", "sciq", "--target-accuracy", "1.5"]) == 2
        assert "target_accuracy must be in (0, 1), got 1.5" in capsys.readouterr().err

    def test_missing_artifact_is_a_clear_error(self, tmp_path, capsys):
        assert main(["--artifact", str(tmp_path / "nope"), "--dataset", "sciq"]) == 2
        assert "not found" in capsys.readouterr().err

    def test_a_sample_that_would_claim_no_count_writes_nothing(self, tiny_artifact, tiny_jsonl, tmp_path, capsys):
        out = tmp_path / "nothing"
        assert main(["--artifact", str(tiny_artifact), "--dataset", "jsonl", "--path", str(tiny_jsonl),
                     "--output", str(out), "--no-progress", "--max-tokens", "96"]) == 2
        err = capsys.readouterr().err
        assert "no option count has the 200 questions --min-per-count asks for in this sample (3 options: " in err
        assert "nothing was written" in err and not out.exists()

    def test_writes_a_new_version_sharing_the_weights(self, tiny_artifact, tiny_jsonl, tmp_path):
        out = tmp_path / "recal"
        rc = main(["--artifact", str(tiny_artifact), "--dataset", "jsonl", "--path", str(tiny_jsonl),
                   "--output", str(out), "--target-accuracy", "0.5", "--no-progress", "--max-tokens", "96",
                   "--min-per-count", "10"])  # the toy file: about 20 questions of each of 3, 4 and 5 options
        assert rc == 0
        before, after = read_manifest(tiny_artifact), read_manifest(out)
        assert after.version == next_version(before.version)
        assert after.calibration["dataset"] == "jsonl" and after.calibration["previous_version"] == before.version
        assert after.calibration["n"] == 60 and after.conformal_sets() is not None
        weights = (out / "adapter_model.safetensors").read_bytes()
        assert weights == (tiny_artifact / "adapter_model.safetensors").read_bytes()
        assert json.loads((out / "manifest.json").read_text())["abstention"]["ood_score"] == "inverse_uncertainty"
        card = (out / "README.md").read_text()  # the model card shows the new version and thresholds
        assert f"(version {after.version})" in card
        assert f"`min_confidence` {num(after.abstention['min_confidence'])}" in card
        assert after.files == before.files and check_artifact(out, verify=True)

    def test_stored_outputs_recalibrate_identically_and_are_tied_to_their_weights(self, tiny_artifact, tiny_jsonl,
                                                                                  tmp_path, capsys):
        common = ["--dataset", "jsonl", "--path", str(tiny_jsonl), "--target-accuracy", "0.5", "--no-progress",
                  "--min-per-count", "10"]
        saved = tmp_path / "outputs.json"
        assert main(["--artifact", str(tiny_artifact), "--output", str(tmp_path / "a"), "--save-outputs", str(saved),
                     "--max-tokens", "96", *common]) == 0
        assert main(["--artifact", str(tiny_artifact), "--output", str(tmp_path / "b"), "--outputs", str(saved),
                     "--evaluate-split", "validation", *common]) == 0
        a, b = read_manifest(tmp_path / "a"), read_manifest(tmp_path / "b")
        # Stored outputs keep 9 significant digits (a float32 exactly, a float64 within 5e-10 relative): the same
        # post-hoc parameter, and thresholds and quantiles within that rounding.
        assert a.head == b.head
        for key in ("min_confidence", "ood_threshold"):
            assert b.abstention[key] == pytest.approx(a.abstention[key], rel=1e-8, abs=1e-12), key
            for count, chosen in a.abstention["by_options"].items():
                assert b.abstention["by_options"][count][key] == pytest.approx(chosen[key], rel=1e-8, abs=1e-12)
        for method, by_alpha in a.conformal["quantiles"].items():
            for alpha, q in by_alpha.items():
                got = b.conformal["quantiles"][method][alpha]
                assert got == q if q is None else got == pytest.approx(q, rel=1e-8, abs=1e-12), (method, alpha)
        assert b.metrics["validation"]["n"] == 60 and b.calibration["evaluated_split"] == "validation"
        # The same outputs against an artifact whose head changed are refused.
        other = tmp_path / "other"
        shutil.copytree(tiny_artifact, other)
        (other / "head.safetensors").write_bytes((other / "head.safetensors").read_bytes() + b" ")
        capsys.readouterr()
        assert main(["--artifact", str(other), "--outputs", str(saved), *common]) == 2
        assert "other weights" in capsys.readouterr().err
        # Outputs computed on torch are not another backend's.
        assert json.loads(saved.read_text())["calibration_key"] == "torch-fp32"
        assert main(["--artifact", str(tiny_artifact), "--output", str(tmp_path / "c"), "--outputs", str(saved),
                     "--backend", "openvino-bf16", *common]) == 2
        assert "holds outputs computed on torch-fp32, not on backend openvino-bf16" in capsys.readouterr().err

    def test_a_gpu_arithmetic_is_calibrated_beside_the_others(self, tiny_artifact, tiny_jsonl, tmp_path, capsys):
        """Outputs computed on a GPU in NF4 (``--device cuda --load-in-4bit`` or ``--backend torch-cuda-nf4-bf16``
        with ``--save-outputs``; here the CPU's, keyed as such a file is) add ``torch-cuda-nf4-bf16`` beside the
        artifact's calibrations, the one ``auto`` serves that arithmetic with; a CPU cannot compute them."""
        common = ["--dataset", "jsonl", "--path", str(tiny_jsonl), "--target-accuracy", "0.5", "--no-progress",
                  "--min-per-count", "10"]
        saved = tmp_path / "outputs.json"
        assert main(["--artifact", str(tiny_artifact), "--output", str(tmp_path / "a"), "--save-outputs", str(saved),
                     "--max-tokens", "96", *common]) == 0
        saved.write_text(json.dumps({**json.loads(saved.read_text()), "calibration_key": "torch-cuda-nf4-bf16"}))
        out = tmp_path / "nf4"
        assert main(["--artifact", str(tiny_artifact), "--output", str(out), "--outputs", str(saved),
                     "--backend", "torch-cuda-nf4-bf16", *common]) == 0
        before, after = read_manifest(tiny_artifact), read_manifest(out)
        assert after.calibration_keys() == ["torch-fp32", "torch-cuda-nf4-bf16"] and after.version == before.version
        assert after.calibration_for("torch-cuda-nf4-bf16").record["backend"] == "torch-cuda-nf4-bf16"
        capsys.readouterr()
        assert main(["--artifact", str(tiny_artifact), "--output", str(tmp_path / "b"), "--outputs", str(saved),
                     "--backend", "torch-cuda-bf16", *common]) == 2
        assert "computed on torch-cuda-nf4-bf16, not on backend torch-cuda-bf16" in capsys.readouterr().err
        assert main(["--artifact", str(tiny_artifact), "--output", str(tmp_path / "c"), "--backend", "torch-cuda-bf16",
                     "--max-tokens", "96", *common]) == 2
        assert "backend 'torch-cuda-bf16' cannot run here: it runs on CUDA; this predictor is on cpu" in \
            capsys.readouterr().err

    def test_questions_from_another_source_drop_the_other_backends_calibrations(self, tiny_artifact, tiny_jsonl,
                                                                                  tmp_path, capsys):
        """An artifact's calibrations describe one source of questions: calibrating on another drops the backends'
        made on the old one (they would promise what held for other questions), with this run's command for each; the
        same file (wherever it lies) or a subset of it keeps them; a stale top-level one (it cannot be dropped) is
        named with its command."""
        common = ["--dataset", "jsonl", "--target-accuracy", "0.5", "--no-progress", "--min-per-count", "10"]
        art, saved = tmp_path / "art", tmp_path / "outputs.json"
        assert main(["--artifact", str(tiny_artifact), "--output", str(art), "--path", str(tiny_jsonl),
                     "--save-outputs", str(saved), "--max-tokens", "96", *common]) == 0
        saved.write_text(json.dumps({**json.loads(saved.read_text()), "calibration_key": "torch-cuda-bf16"}))
        assert main(["--artifact", str(art), "--path", str(tiny_jsonl), "--outputs", str(saved),
                     "--backend", "torch-cuda-bf16", *common]) == 0
        assert read_manifest(art).calibration_keys() == ["torch-fp32", "torch-cuda-bf16"]
        # the same questions from a copy of the file, a subset of them, other targets: both kept, nothing said
        copy = tmp_path / "copy.jsonl"
        shutil.copy(tiny_jsonl, copy)
        for n, extra in enumerate((["--target-accuracy", "0.6"], ["--limit", "45", "--seed", "3"])):
            capsys.readouterr()
            assert main(["--artifact", str(art), "--output", str(tmp_path / f"same{n}"), "--path", str(copy),
                         "--max-tokens", "96", *common, *extra]) == 0
            assert read_manifest(tmp_path / f"same{n}").calibration_keys() == ["torch-fp32", "torch-cuda-bf16"]
            out, err = capsys.readouterr()
            assert json.loads(out)["dropped"] == [] and "dropped" not in err
        # other questions: the GPU calibration is dropped, a new version, and this run's command for it is said
        mine_file = tmp_path / "mine.jsonl"
        rows = [json.loads(line) for line in tiny_jsonl.read_text().splitlines()]
        mine_file.write_text("".join(json.dumps({**r, "question": "Mine: " + r["question"]}) + "\n" for r in rows))
        mine = tmp_path / "mine"
        capsys.readouterr()
        assert main(["--artifact", str(art), "--output", str(mine), "--path", str(mine_file), "--max-tokens", "96",
                     *common]) == 0
        out, err = capsys.readouterr()
        after = read_manifest(mine)
        assert after.calibration_keys() == ["torch-fp32"] and after.calibration["path"] == str(mine_file)
        assert after.version == next_version(read_manifest(art).version)
        assert json.loads(out)["dropped"] == ["torch-cuda-bf16"] and json.loads(out)["stale"] == []
        assert "dropped the torch-cuda-bf16 calibration: it was made on other questions" in err
        assert (f"python -m ibedl.training.calibrate --artifact {mine} --path {mine_file} --max-tokens 96 "
                f"{' '.join(common)} --backend torch-cuda-bf16 --device cuda") in err
        assert read_manifest(art).calibration_keys() == ["torch-fp32", "torch-cuda-bf16"]  # the source untouched
        # a backend calibrated on other questions than the top level's: the top level stays, named as stale
        mine_out = tmp_path / "mine-outputs.json"
        assert main(["--artifact", str(tiny_artifact), "--output", str(tmp_path / "scratch"), "--path", str(mine_file),
                     "--save-outputs", str(mine_out), "--max-tokens", "96", *common]) == 0
        mine_out.write_text(json.dumps({**json.loads(mine_out.read_text()), "calibration_key": "torch-cuda-bf16"}))
        capsys.readouterr()
        assert main(["--artifact", str(art), "--output", str(tmp_path / "gpu"), "--path", str(mine_file),
                     "--outputs", str(mine_out), "--backend", "torch-cuda-bf16", *common]) == 0
        out, err = capsys.readouterr()
        assert json.loads(out)["stale"] == ["torch-fp32"] and json.loads(out)["dropped"] == []
        assert read_manifest(tmp_path / "gpu").calibration_keys() == ["torch-fp32", "torch-cuda-bf16"]
        assert "warning: the top-level torch-fp32 calibration was made on other questions" in err
        # from stored outputs no command line says how they were computed (option counts asked...): the file does
        assert (f"recalibrate it on these (compute that backend's outputs as {mine_out}'s were computed, with "
                "--backend torch --device cpu --dtype float32)") in err

    def test_a_backend_calibration_is_added_beside_the_others(self, tiny_artifact, tiny_jsonl, tmp_path):
        pytest.importorskip("openvino")
        from ibedl.core.predictor import Predictor

        out = tmp_path / "ov"
        assert main(["--artifact", str(tiny_artifact), "--dataset", "jsonl", "--path", str(tiny_jsonl),
                     "--output", str(out), "--target-accuracy", "0.5", "--no-progress", "--max-tokens", "96",
                     "--backend", "openvino-fp32", "--min-per-count", "10"]) == 0
        before, after = read_manifest(tiny_artifact), read_manifest(out)
        assert after.calibration_keys() == ["torch-fp32", "openvino-fp32"]
        # the torch calibration is untouched: the same top-level sections and head, the same version (its answers)
        for name in ("head", "abstention", "conformal", "calibration", "reference", "metrics", "version"):
            assert getattr(after, name) == getattr(before, name), name
        mine = after.calibration_for("openvino-fp32")
        assert mine.record["backend"] == "openvino-fp32" and mine.record["n"] == 60
        assert mine.conformal is not None and "zeta" in mine.head
        predictor = Predictor.from_artifact(out, backend="openvino-fp32")
        assert predictor.calibration.key == "openvino-fp32"
        assert predictor.head.config.zeta == mine.head["zeta"]
        assert Predictor.from_artifact(out).calibration.key == "torch-fp32"

    def test_static_int8_is_calibrated_on_the_sample_the_artifact_carries(self, tiny_artifact, tiny_jsonl, tmp_path,
                                                                          capsys):
        pytest.importorskip("nncf")
        from ibedl.core import cpu_isa, quantization_sample
        from ibedl.core.predictor import Predictor

        common = ["--dataset", "jsonl", "--path", str(tiny_jsonl), "--target-accuracy", "0.5", "--no-progress",
                  "--min-per-count", "10", "--max-tokens", "96"]
        art, saved = tmp_path / "art", tmp_path / "int8.json"
        shutil.copytree(tiny_artifact, art)
        assert main(["--artifact", str(art), "--backend", "openvino-int8", "--save-outputs", str(saved), *common]) == 0
        sha = quantization_sample.sha256(art)  # written from the training split, then quantised on
        rows = len(tiny_jsonl.read_text().splitlines())
        assert read_manifest(art).calibration_for("openvino-int8").record["quantization"] == {
            "file": "quantization_sample.jsonl", "questions": rows, "sha256": sha,
            "isa": cpu_isa.int8_isa()}
        assert json.loads(saved.read_text())["int8_isa"] == cpu_isa.int8_isa()
        assert Predictor.from_artifact(art, backend="openvino-int8").quantized_on == sha
        # recalibrating from its outputs into another directory takes the sample along
        assert main(["--artifact", str(art), "--output", str(tmp_path / "copy"), "--outputs", str(saved),
                     "--backend", "openvino-int8", *common[:-2]]) == 0
        assert quantization_sample.sha256(tmp_path / "copy") == sha
        # int8 outputs for an artifact that does not hold the questions its trunk was quantised on: refused
        bare = tmp_path / "bare"
        shutil.copytree(tiny_artifact, bare)
        capsys.readouterr()
        assert main(["--artifact", str(bare), "--outputs", str(saved), "--backend", "openvino-int8",
                     *common[:-2]]) == 2
        assert "carries no quantization_sample.jsonl" in capsys.readouterr().err


class TestWhatTheBackendDeclares:
    """Calibration asks the backend, never tests its name: a registered backend that declares ``static_int8``
    records its quantisation sample and int8 class, and ``--backend`` names every key a backend owns."""

    def test_a_registered_static_int8_backend_records_its_sample_and_int8_class(self, tmp_path, monkeypatch):
        from ibedl.core import backends, quantization_sample
        from ibedl.core.prompt import MCQuestion
        from ibedl.training.calibrate import outputs_isa, quantization_record
        from tests.core.test_backend_registry import EagerTrunk

        monkeypatch.setitem(backends.REGISTRY, "npu-int8", EagerTrunk("npu-int8", static_int8=True, calls=[]))
        with pytest.raises(ValueError, match="carries no quantization_sample.jsonl.*--backend npu-int8 writes"):
            quantization_record(tmp_path, "npu-int8")
        sha = quantization_sample.write(tmp_path, [MCQuestion("Which is sun?", ("sun", "moon"), answer=0)])
        assert quantization_record(tmp_path, "npu-int8", "avx2") == {
            "file": quantization_sample.FILE, "questions": 1, "sha256": sha, "isa": "avx2"}
        assert quantization_record(tmp_path, "openvino-fp32") is None and quantization_record(tmp_path, "x") is None
        outputs = tmp_path / "outputs.json"
        outputs.write_text(json.dumps({"calibration_key": "npu-int8"}))  # computed on int8, its class not recorded
        with pytest.raises(ValueError, match="--backend npu-int8 --save-outputs FILE"):
            outputs_isa(outputs, "npu-int8")
        assert outputs_isa(outputs, "openvino-fp32") is None

    def test_backend_names_the_keys_it_owns(self, tmp_path):
        from ibedl.training.calibrate import outputs_key

        outputs = tmp_path / "outputs.json"
        outputs.write_text(json.dumps({"calibration_key": "torch-cuda-bf16", "streams": {}}))
        assert outputs_key(outputs, "torch") == outputs_key(outputs, None) == "torch-cuda-bf16"  # any precision
        with pytest.raises(ValueError, match="computed on torch-cuda-bf16, not on backend openvino-fp32"):
            outputs_key(outputs, "openvino-fp32")
        outputs.write_text(json.dumps({"calibration_key": "openvino-int8", "streams": {}}))
        with pytest.raises(ValueError, match="computed on openvino-int8, not on backend openvino:"):
            outputs_key(outputs, "openvino")  # its name begins the key, but the key is another backend's


class TestFeedbackSample:
    """``--dataset feedback``: a recalibration on the labels sent back to the service, with the outputs its
    receipts carried (the model does not run again)."""

    def test_recalibrates_on_the_recorded_labels(self, tiny_artifact, tiny_jsonl, tmp_path):
        import ibedl
        from ibedl.core.artifact import read_manifest
        from ibedl.training.calibrate import calibrate_outputs, feedback_outputs

        db = tmp_path / "feedback.sqlite"
        model = ibedl.load(tiny_artifact, max_tokens=96, feedback_key="calibrate-feedback-key", feedback_db=db)
        rows = [json.loads(line) for line in tiny_jsonl.read_text().splitlines()]
        answers = model.predict([{"question": r["question"], "options": r["options"]} for r in rows])
        labels = [model.record_feedback([{"receipt": a.receipt, "label": "A"}]) for a in answers]  # answer: A
        assert sum(r.recorded for r in labels) == len(rows)

        manifest = read_manifest(tiny_artifact)
        kind, raw, ys, key = feedback_outputs(db, manifest)
        assert key == "torch-fp32"  # the receipts name the calibration that answered
        assert ys == [0] * len(rows) and len(raw["probs"]) == len(rows)
        assert raw["probs"][0] == pytest.approx(list(answers[0].probabilities.values()), abs=1e-6)
        out = tmp_path / "recalibrated"
        assert main(["--artifact", str(tiny_artifact), "--dataset", "feedback", "--path", str(db),
                     "--output", str(out), "--min-per-count", "10"]) == 0
        new = read_manifest(out)
        assert new.version == next_version(str(manifest.version)) and new.calibration["dataset"] == "feedback"
        assert new.head == manifest.head  # the served post-hoc parameter stays
        # the stored decisions are those of calibrate_outputs on the served outputs, without a post-hoc refit
        _, _, sections = calibrate_outputs(kind, raw, ys, CalibrationConfig(posthoc=False, min_per_count=10))
        assert new.conformal["quantiles"] == sections["conformal"]["quantiles"]
        assert new.abstention["min_confidence"] == sections["abstention"]["min_confidence"]

    def test_a_backend_calibrations_own_post_hoc_parameter_stays(self, tiny_artifact, tiny_jsonl, tmp_path):
        """Labels of answers served on a backend whose calibration carries its own zeta: the recalibration keeps that
        zeta (it recorded none, so a restarted replica served the top level's: other numbers than those its
        thresholds were set on)."""
        import shutil

        import ibedl
        from ibedl.core.artifact import read_manifest, write_manifest

        art = tmp_path / "own-zeta"
        shutil.copytree(tiny_artifact, art)
        m = read_manifest(art)
        assert m.calibrated_on == "torch-fp32" and "zeta" in m.head
        made_with = {**m.calibration, "config": {**m.calibration["config"], "ood_rejection_rate": 0.2, "alpha": 0.2,
                                                 "main_options": 6}}  # no label has 6 options
        own = {"head": {"zeta": m.head["zeta"] - 0.5}, "metrics": {}, "abstention": m.abstention,
               "conformal": m.conformal, "calibration": made_with, "reference": m.reference}
        m.backend_calibrations["torch-fp32"], m.calibrated_on = own, "openvino-fp32"  # torch serves its own zeta
        write_manifest(art, m)
        db = tmp_path / "feedback.sqlite"
        rows = [json.loads(line) for line in tiny_jsonl.read_text().splitlines()]
        with ibedl.load(art, max_tokens=96, feedback_key="calibrate-feedback-key", feedback_db=db,
                        backend="torch") as model:
            answers = model.predict([{"question": r["question"], "options": r["options"]} for r in rows])
            for a in answers:
                model.record_feedback([{"receipt": a.receipt, "label": "A"}])
        out = tmp_path / "recalibrated"
        assert main(["--artifact", str(art), "--dataset", "feedback", "--path", str(db), "--output", str(out),
                     "--min-per-count", "10", "--alpha", "0.1"]) == 0
        new = read_manifest(out).backend_calibrations["torch-fp32"]
        assert new["head"] == own["head"]  # it was {}
        # the settings the served calibration was made with, but for those the command gives (the gate's 0.2 was
        # the command line's default, 0.05, silently)
        assert {k: new["calibration"]["config"][k] for k in ("ood_rejection_rate", "alpha", "min_per_count")} == {
            "ood_rejection_rate": 0.2, "alpha": 0.1, "min_per_count": 10}
        # a main count the labels do not hold enough of is not kept (it was a ValueError's traceback): the labels'
        # most common count is the main one
        assert new["calibration"]["config"]["main_options"] is None

    def test_only_the_answers_of_one_calibration_are_taken(self, caplog):
        from ibedl.training.calibrate import of_one_calibration

        rows = ([{"calibration": "openvino-int8"}] * 5 + [{"calibration": "torch-fp32"}] * 2
                + [{"calibration": None}])
        with caplog.at_level("WARNING", logger="ibedl.training.calibrate"):
            kept, key = of_one_calibration(rows, None, "torch-fp32")  # the one most answers name
        assert key == "openvino-int8" and len(kept) == 5 and "3 answered on other backends" in caplog.text
        assert of_one_calibration(rows, "torch", "torch-fp32")[1] == "torch-fp32"  # --backend torch: any precision
        assert len(of_one_calibration(rows, "openvino-fp32", "torch-fp32")[0]) == 0  # none answered there
        # a backend's keys are the ones it owns, not every key its name begins: openvino-int8's are not openvino's
        assert of_one_calibration(rows, "openvino", "torch-fp32") == ([], "openvino")
        older = [{"calibration": None}] * 3  # receipts signed before they named one: the top level's
        assert of_one_calibration(older, None, "torch-fp32") == (older, "torch-fp32")
        with pytest.raises(ValueError, match="served on"):
            of_one_calibration([{"calibration": "torch-fp32"}, {"calibration": "torch-cuda-bf16"}], "torch", "x")

    @pytest.mark.servers
    def test_a_postgresql_store_is_read_by_its_dsn_and_its_password_never_shown(self, tiny_artifact, postgres_dsn,
                                                                                  capsys):
        from ibedl.engine.feedback_postgres import PostgresStore

        PostgresStore(postgres_dsn).close()  # the service's tables, no labels yet
        assert main(["--artifact", str(tiny_artifact), "--dataset", "feedback", "--path", postgres_dsn]) == 2
        err = capsys.readouterr().err
        password = postgres_dsn.split("://", 1)[1].split("@", 1)[0].split(":", 1)[1]
        assert "holds 0 labels of adapter" in err and password not in err
        from ibedl.training.calibrate import without_password

        user = postgres_dsn.split("://", 1)[1].split(":", 1)[0]
        shown = without_password(postgres_dsn)
        assert password not in shown and f"{user}@" not in shown and shown.startswith("postgresql://")
        assert without_password("runs/feedback.sqlite") == "runs/feedback.sqlite" and without_password(None) is None

    @pytest.mark.parametrize("dsn", [
        "postgresql://u@db.example:5432/ibedl?password=s3cret&sslmode=require",
        "postgresql://u:s3cret@db.example:5432/ibedl",
        "postgres://u:s3cret@db.example/ibedl?sslpassword=s3cret",
        "host=db.example port=5432 dbname=ibedl user=u password=s3cret",
        "port=5432 host=db.example dbname=ibedl user=u password='s3cret'"])
    def test_every_form_of_dsn_is_redacted_to_host_port_and_database(self, dsn):
        """User info and query parameters (which may carry the password) never reach a record or a message, whether
        the DSN is the whole text, an argument of a command line or the value of a --path= option."""
        from ibedl.training.calibrate import is_dsn, without_password

        shown = without_password(dsn)
        assert is_dsn(dsn) and "s3cret" not in shown and "u@" not in shown and "user" not in shown
        assert shown.startswith("postgresql://db.example") and shown.endswith("/ibedl")
        for command in (f"python -m ibedl.training.calibrate --path {dsn} --dataset feedback", f"--path={dsn}"):
            assert "s3cret" not in without_password(command), command
        assert not is_dsn("runs/feedback.sqlite") and not is_dsn("runs/a=b.sqlite")

    def test_too_few_labels_or_another_version_is_a_clear_error(self, tiny_artifact, tmp_path, capsys):
        from ibedl.engine.feedback_sqlite import SqliteStore

        db = tmp_path / "feedback.sqlite"
        SqliteStore(db).close()
        assert main(["--artifact", str(tiny_artifact), "--dataset", "feedback", "--path", str(db)]) == 2
        assert "holds 0 labels of adapter" in capsys.readouterr().err
        assert main(["--artifact", str(tiny_artifact), "--dataset", "feedback"]) == 2
        assert "needs --path" in capsys.readouterr().err
