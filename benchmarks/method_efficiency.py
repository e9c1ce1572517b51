"""Training and test cost of the nine methods as ratios to MAP, one run at a time on otherwise quiet cores.

    python -m benchmarks.method_efficiency [--config benchmarks/sciq_grid.yaml] [--train 96] [--validation 50]
        [--test 96] [--methods map ib_edl ...] [--output benchmarks/results/method_efficiency.json]

The grid's recipe (the config's ``train`` section and ``method_params``) on a smaller SciQ draw, seed 0. The grid
itself records the same columns, but its runs share the cores (``--jobs``) and the first run of each seed, MAP's,
fills the prefix cache the later ones read; here one run goes at a time, every training and every test pass in its
own child process (peak RSS from wait4, ``ibedl.training.experiments.benchmark.Runner``), after an untimed MAP run that
fills the prefix cache for these questions. MC-Dropout and Laplace reuse MAP's training (their train columns are
MAP's); Laplace's predictive fit (KFAC curvature on ``fit_samples`` training questions and its prior precision chosen
on the validation questions) is reported on its own, apart from its test samples/s.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path

from benchmarks.common import cpu_features, write_result
from ibedl.training.config import yaml_load
from ibedl.training.experiments.benchmark import Run, Runner
from ibedl.training.experiments.report import EFFICIENCY_KEYS
from ibedl.training.methods import METHODS, get_method


def efficiency_config(config: dict, methods: list[str], train: int, validation: int, test: int) -> dict:
    """The benchmark config for one in-distribution SciQ cell per method, seed 0, at the given sizes."""
    return {**config, "name": "method_efficiency", "methods": methods, "seeds": [0],
            "sizes": {"default": {"train": train, "validation": validation, "test": test}},
            "experiments": [{"kind": "id", "datasets": ["sciq"]}]}


def measure(config: dict, root: Path) -> dict:
    """Per method: the Runner's efficiency record, its training run (seconds, samples) and any predictive fit."""
    Runner({**config, "methods": ["map"]}, root / "warm-up", root / "warm-up.json").run(
        Run("id", "id", "sciq", "map", 0, ("sciq",)))  # fills the prefix cache; not measured
    runner = Runner(config, root / "runs", root / "results.json")
    out = {}
    for method in [m for m in METHODS if m in config["methods"]]:
        logging.getLogger("benchmarks.method_efficiency").info("measuring %s", method)
        cell = Run("id", "id", "sciq", method, 0, ("sciq",))
        record = runner.run(cell)
        trained = get_method(method).trained_as
        run = json.loads((root / "runs" / cell.train_key(trained) / "manifest.json").read_text())["training"]["run"]
        out[method] = {**record["efficiency"], "accuracy": record["metrics"]["accuracy"],
                       "train_seconds": run["seconds"], "train_samples": run["samples"],
                       "reuses_training_of": trained if trained != method else None}
        if record.get("posthoc"):
            out[method]["posthoc"] = record["posthoc"]
    return out


def with_ratios(methods: dict) -> dict:
    """Each method's numbers with ``ratio_to_map``: throughputs and peak memories divided by MAP's."""
    ref = methods["map"]
    return {m: {**v, "ratio_to_map": {k: v[k] / ref[k] for k in (*EFFICIENCY_KEYS, "train_seconds")
                                      if v.get(k) and ref.get(k)}}
            for m, v in methods.items()}


def table(methods: dict) -> str:
    """One line per method: each efficiency column and its ratio to MAP ("–" where it was not measured)."""
    heads = {"train_samples_per_s": ("train/s", ".2f"), "test_samples_per_s": ("test/s", ".2f"),
             "train_peak_rss_mib": ("train MiB", ".0f"), "eval_peak_rss_mib": ("test MiB", ".0f")}
    lines = [f"{'method':<11}" + "".join(f" {heads[k][0]:>9} {'x MAP':>6}" for k in EFFICIENCY_KEYS)]
    for m, v in methods.items():
        cells = []
        for k in EFFICIENCY_KEYS:
            value, ratio = v.get(k), v["ratio_to_map"].get(k)
            cells.append(f" {'–' if value is None else format(value, heads[k][1]):>9} "
                         f"{'–' if ratio is None else format(ratio, '.2f'):>6}")
        lines.append(f"{m:<11}" + "".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.method_efficiency",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="benchmarks/sciq_grid.yaml", help="the grid whose recipe is measured")
    parser.add_argument("--methods", nargs="*", help="default: the config's methods (MAP is always measured)")
    parser.add_argument("--train", type=int, default=96, help="training questions per run (default 96)")
    parser.add_argument("--validation", type=int, default=50, help="validation questions (default 50)")
    parser.add_argument("--test", type=int, default=96, help="SciQ test questions per pass (default 96)")
    parser.add_argument("--output", default="benchmarks/results/method_efficiency.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        config = yaml_load(Path(args.config).read_text())
        methods = args.methods or config["methods"]
        unknown = sorted(set(methods) - set(METHODS))
        if unknown:
            raise ValueError(f"unknown methods {unknown}; known: {list(METHODS)}")
        for name, value in (("--train", args.train), ("--validation", args.validation), ("--test", args.test)):
            if value < 8:
                raise ValueError(f"{name} must be >= 8, got {value}")
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    config = efficiency_config(config, sorted({"map", *methods}, key=list(METHODS).index), args.train,
                               args.validation, args.test)
    with tempfile.TemporaryDirectory(prefix="method-efficiency-") as tmp:
        measured = with_ratios(measure(config, Path(tmp)))
    write_result(args.output, {
        "command": "python -m benchmarks.method_efficiency " + " ".join(argv if argv is not None else sys.argv[1:]),
        "config": args.config, "sizes": config["sizes"]["default"], "base_model": config["train"]["base_model"],
        "cpu": cpu_features(),
        "note": "one run at a time; MC-Dropout and Laplace reuse MAP's training; Laplace's test samples/s exclude its "
                "post-hoc fit (posthoc fit_seconds), its test peak memory includes it (the fit and the test pass are "
                "one child process)",
        "methods": measured,
    }, echo=False)
    print(table(measured))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
