import pytest

from ibedl.training.config import apply_overrides, config_keys_help, load_config, yaml_load

BASE = ["method=map", "output=/tmp/x", "data={train: [{dataset: sciq}], validation: [{dataset: sciq, limit: 5}]}"]


def test_every_shipped_config_loads():
    from pathlib import Path

    for path in sorted(Path("ibedl/training/configs").glob("*.yaml")):
        first = path.read_text().splitlines()[0]
        assert first == f"# python -m ibedl.training.finetune --config {path}", path  # configs start with their command
        cfg = load_config(path)
        assert cfg.data.train and cfg.data.validation


def test_scientific_notation_is_a_float():
    assert yaml_load("lr: 1e-3\nx: 5.0e-5\nname: 1e3x") == {"lr": 0.001, "x": 5e-05, "name": "1e3x"}


def test_overrides_nested_and_typed():
    data = apply_overrides({"optim": {"lr": 1.0}}, ["optim.lr=2e-4", "lora.targets=[q_proj]", "seed=3"])
    assert data == {"optim": {"lr": 2e-4}, "lora": {"targets": ["q_proj"]}, "seed": 3}
    with pytest.raises(ValueError, match="must look like key.sub=value"):
        apply_overrides({}, ["nonsense"])


@pytest.mark.parametrize("override,message", [
    ("optim.lr=-1", "optim.lr must be > 0, got -1"),
    ("optim.batch_size=0", "optim.batch_size must be an integer >= 1, got 0"),
    ("optim.max_steps=0", "optim.max_steps must be >= 1, got 0"),  # trained nothing, then wrote an artifact
    ("optim.max_steps=-2", "optim.max_steps must be >= 1, got -2"),
    ("optim.head_lr=-1", "optim.head_lr must be > 0, got -1"),  # gradient ascent on the head
    ("optim.weight_decay=-0.1", "optim.weight_decay must be >= 0, got -0.1"),
    ("optim.clip_grad_norm=0", "optim.clip_grad_norm must be > 0, got 0"),
    ("optim.lr=[", "override 'optim.lr=\\[': the value is not YAML"),  # was yaml's ParserError, a traceback
    ("lora.dropout=1.5", "lora.dropout must be in \\[0, 1\\), got 1.5"),
    ("data.label_noise=1.0", "data.label_noise must be in \\[0, 1\\), got 1.0"),
    ("optim.bogus=1", "unknown config keys \\['optim.bogus'\\]"),
    ("evidence_bias=sideways", "evidence_bias must be 'center', 'none' or a finite float32 number"),
    ("evidence_bias=.nan", "evidence_bias must be 'center', 'none' or a finite float32 number, got nan"),
    ("evidence_bias=1e39", "evidence_bias must be .* got 1e\\+39"),  # was a RuntimeError filling the head
    ("optim.lr=.inf", "optim.lr: input should be a finite number, got inf"),  # trained to a NaN loss's traceback
    ("optim.epochs=.inf", "optim.epochs: input should be a finite number, got inf"),  # OverflowError making steps
    ("optim.weight_decay=.nan", "optim.weight_decay: input should be a finite number, got nan"),
    ("lora.alpha=.nan", "lora.alpha: input should be a finite number, got nan"),
    ("lora.alpha=0", "lora.alpha must be > 0, got 0"),  # scaled the adapter to nothing: no LoRA
    ("evidence_scale=0", "evidence_scale must be a finite number > 0, got 0"),
    ("evidence_scale=-2.5", "evidence_scale must be a finite number > 0, got -2.5"),
])
def test_bad_values_are_named(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, BASE + [override])


def test_help_lists_every_config_key_with_its_default():
    cfg = load_config(None, ["method=map", "output=/tmp/x",
                             "data={train: [{dataset: sciq}], validation: [{dataset: sciq}]}"])

    def flat(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict) and k in ("data", "lora", "optim"):
                yield from flat(v, prefix + k + ".")
            else:
                yield prefix + k, v

    keys = dict(flat(cfg.to_dict()))
    text = config_keys_help()
    keys_part, _, methods_part = text.partition("method_params (per method, with their defaults):")
    lines = keys_part.strip().splitlines()[1:]
    listed = {line.split(" = ")[0].strip(): line.split(" = ", 1)[1] for line in lines}
    assert set(listed) == set(keys)
    assert "  ib_edl: beta = 0.001, num_samples = 20, risk = mse," in methods_part
    assert "  laplace: fit_samples = 200, prior_precision = validation," in methods_part
    assert listed["optim.lr"] == "5e-05" and listed["lora.targets"] == "['q_proj', 'v_proj']"
    assert listed["method"] == "(required)" and listed["data.validation"] == "(required)"
