"""benchmarks/gradient_checkpointing.py run for real on the CPU: the recipe's model and loss, both settings on the
same batches, the same gradients, fewer kept activations with checkpointing on."""

from __future__ import annotations

import json

import pytest

from benchmarks import gradient_checkpointing


@pytest.mark.integration
def test_both_settings_run_on_the_same_batches_with_the_same_gradients(tmp_path, monkeypatch):
    from tests.conftest import shared_cache_dir

    monkeypatch.setenv("IBEDL_CACHE_DIR", shared_cache_dir())
    out = tmp_path / "gc.json"
    assert gradient_checkpointing.main(["--batch-size", "2", "--steps", "2", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["cpu"]["cores"] >= 1 and result["method"] == "ib_edl"
    assert result["batches"] == 2 and result["mean_prompt_tokens"] > 0
    assert result["gradient_max_rel_diff"] < 1e-5  # checkpointing recomputes the same arithmetic
    off, on = result["settings"]["off"], result["settings"]["on"]
    assert on["mean_kept_activation_mib"] < 0.2 * off["mean_kept_activation_mib"]
    assert result["on_vs_off"]["kept_activations"] == pytest.approx(
        on["mean_kept_activation_mib"] / off["mean_kept_activation_mib"])
    assert set(result["on_vs_off"]["step_time"]) == {"ratio", "low", "high"}
    assert off["peak_allocated_mib"] is None  # a CUDA figure


@pytest.mark.parametrize(("argv", "says"), [(["--steps", "1"], "--steps >= 2"),
                                            (["--batch-size", "0"], "--batch-size must be >= 1"),
                                            (["--device", "tpu"], "--device must be cpu or cuda, got 'tpu'")])
def test_bad_arguments_are_refused_by_name(argv, says, capsys):
    with pytest.raises(SystemExit):
        gradient_checkpointing.main(argv)
    assert says in capsys.readouterr().err
