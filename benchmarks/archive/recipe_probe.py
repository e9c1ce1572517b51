"""Which base model and recipe learn? Train a grid of short MAP runs and report test accuracy.

    python -m benchmarks.archive.recipe_probe --grid benchmarks/archive/recipe_probe.yaml [--device cuda] [--only NAME ...]

Each grid entry is a set of ``ibedl.training.finetune`` overrides on top of the grid's ``base``; runs that
already have a result in the output JSON are skipped (safe to interrupt and resume). The results file
lists, per run, its overrides, test accuracy/NLL/ECE, training samples/s and seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ibedl.training.config import load_config, yaml_load
from ibedl.training.finetune import train


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--grid", required=True)
    parser.add_argument("--output", help="results JSON (default benchmarks/archive/results/<grid name>.json)")
    parser.add_argument("--device", help="cpu or cuda (default: the grid's, else auto)")
    parser.add_argument("--only", nargs="*", help="run only these entries")
    parser.add_argument("--model-path", action="append", default=[], metavar="NAME=REF",
                        help="resolve base model NAME to REF (an HF directory or .gguf), e.g. on a machine "
                        "without the model's PyPI package")
    parser.add_argument("--runs-dir", default="runs/recipe_probe")
    args = parser.parse_args(argv)
    grid = yaml_load(Path(args.grid).read_text())
    out = Path(args.output or f"benchmarks/archive/results/{Path(args.grid).stem}.json")
    results = json.loads(out.read_text()) if out.is_file() else []
    done = {r["name"] for r in results}
    for entry in grid["runs"]:
        name = entry["name"]
        if name in done or (args.only and name not in args.only):
            continue
        overrides = {**grid.get("base", {}), **entry.get("set", {})}
        if args.device:
            overrides["device"] = args.device
        paths = dict(item.split("=", 1) for item in args.model_path)
        overrides["base_model"] = paths.get(overrides["base_model"], overrides["base_model"])
        pairs = [f"{k}={json.dumps(v)}" for k, v in overrides.items()]
        pairs += [f"output={args.runs_dir}/{name}", "progress=false", f"name={name}"]
        cfg = load_config(None, pairs)
        start = time.time()
        artifact = train(cfg, command=" ".join(pairs))
        manifest = json.loads((artifact / "manifest.json").read_text())
        test = manifest["metrics"].get("test", {})
        record = {
            "name": name,
            "overrides": overrides,
            "test": {k: test.get(k) for k in ("n", "accuracy", "nll", "ece", "brier")},
            "validation": {k: manifest["metrics"]["validation"].get(k) for k in ("n", "accuracy", "nll", "ece", "brier")},
            "zeta": (manifest["training"].get("zeta") or {}).get("zeta"),
            "train_samples_per_s": manifest["training"]["run"]["samples_per_s"],
            "train_samples": manifest["training"]["run"]["samples"],
            "seconds": time.time() - start,
            "device": manifest["training"]["device"],
        }
        results.append(record)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2) + "\n")
        print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
