"""How far apart the same grid config lands on two devices: the noise floor under which a CPU-vs-GPU difference
(or any difference smaller than it) cannot be read as an effect (issue 57 item 3).

    git show ce7a01b:benchmarks/results/sciq_grid.json > /tmp/sciq_grid_cpu.json   (the grid on 2 CPU cores)
    python -m benchmarks.device_floor --a /tmp/sciq_grid_cpu.json --a-device cpu \
        --b benchmarks/results/sciq_grid.json --b-device h100 --output benchmarks/results/device_floor.json

Two result files of one grid config (``ibedl.training.experiments.benchmark``), run on different devices, are paired
by cell key. Only the cells that trained a run count (the OOD cells of a seed read the in-distribution cell's run).
A pair is comparable when both runs had the same step budget (the schedule's length) and kept the same training
step(s): then the two kept states had the same data, order, schedule and number of updates, and differ only by the
devices' arithmetic and random streams (dropout masks, IB-EDL's sampled evidences). Patience does not enter: the
schedule follows the budget, validation passes come at every epoch's end whatever the patience, and the CPU's
patience-5 cells of seed 0 (e3f92e8) match its patience-2 ones to 1e-7. Pairs that kept their start (step 0) measure
evaluation alone; pairs that kept another step measure training and evaluation. Pairs that kept different steps (or
whose steps are not recorded) are listed, not summarised: another patience picks another epoch, and so can the
device (EDL on seed 2 kept step 190 on the CPU at patience 5 and 380 on the H100), so the floor is the one of runs
whose stopping the device did not change.

Per pair: test accuracy, ECE and NLL of b minus a (accuracy and ECE in points). Summary per group: the number of
pairs, the largest absolute difference and the mean absolute difference of each metric, and the method of the
largest.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.common import write_result

METRICS = {"accuracy": 100.0, "ece": 100.0, "nll": 1.0}  # metric -> scale of its difference (points for rates)


def trained_cells(records: list[dict], source: str = "results") -> dict[str, dict]:
    """The cells that trained a run, by key: every record but the OOD ones (they share the run of their seed).
    ``source`` names the file in errors."""
    if not isinstance(records, list):
        raise ValueError(f"{source}: a grid result file holds a list of records, got {type(records).__name__}")
    cells = {}
    for i, r in enumerate(records):
        if not isinstance(r, dict) or not {"key", "kind", "method", "seed", "metrics"} <= r.keys():
            raise ValueError(f"{source}: record {i} is not a grid cell (key, kind, method, seed, metrics)")
        if r["kind"] != "ood" and r.get("training"):
            missing = sorted({"n", *METRICS} - r["metrics"].keys())
            if missing:
                raise ValueError(f"{source}: {r['key']}: metrics lack {missing}")
            cells[r["key"]] = r
    return cells


def comparable(p: dict) -> bool:
    """The same budget and the same recorded kept steps on both devices."""
    return p["budget_a"] == p["budget_b"] and p["steps_a"] == p["steps_b"] and None not in p["steps_a"]


def pair(a: dict, b: dict) -> dict:
    """One cell on both devices: its kept steps and b minus a on each metric (accuracy and ECE in points)."""
    steps_a, steps_b = a["training"].get("best_steps") or [None], b["training"].get("best_steps") or [None]
    if a["metrics"]["n"] != b["metrics"]["n"]:
        raise ValueError(f"{a['key']}: {a['metrics']['n']} test questions in a, {b['metrics']['n']} in b: "
                         "not the same grid config")
    return {"key": a["key"], "method": a["method"], "seed": a["seed"], "kind": a["kind"],
            "n": a["metrics"]["n"], "steps_a": steps_a, "steps_b": steps_b,
            "budget_a": a["training"].get("budget_steps"), "budget_b": b["training"].get("budget_steps"),
            **{m: (b["metrics"][m] - a["metrics"][m]) * scale for m, scale in METRICS.items()}}


def summary(pairs: list[dict]) -> dict:
    """Number of pairs, and per metric the largest and the mean absolute difference and the largest's cell."""
    out: dict = {"pairs": len(pairs)}
    for m in METRICS:
        if not pairs:
            continue
        worst = max(pairs, key=lambda p: abs(p[m]))
        out[m] = {"max_abs": abs(worst[m]), "mean_abs": sum(abs(p[m]) for p in pairs) / len(pairs),
                  "max_at": worst["key"] if worst[m] else None}
    return out


def compare(a_records: list[dict], b_records: list[dict], names: tuple[str, str] = ("a", "b")) -> dict:
    """Pair two devices' results of one config by cell (see the module docstring); ``names`` name them in errors."""
    a, b = trained_cells(a_records, names[0]), trained_cells(b_records, names[1])
    pairs = [pair(a[k], b[k]) for k in sorted(a.keys() & b.keys())]
    same = [p for p in pairs if comparable(p)]
    start = [p for p in same if not any(p["steps_a"])]
    trained = [p for p in same if any(p["steps_a"])]
    return {"evaluation_only": summary(start), "training_and_evaluation": summary(trained),
            "by_method": {m: summary([p for p in trained if p["method"] == m])
                          for m in sorted({p["method"] for p in trained})},
            "other_steps": [{k: p[k] for k in ("key", "steps_a", "steps_b", "budget_a", "budget_b")}
                            for p in pairs if not comparable(p)],
            "only_in_a": sorted(a.keys() - b.keys()), "only_in_b": sorted(b.keys() - a.keys()), "pairs": pairs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.device_floor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", required=True, help="one device's grid results (a JSON list of records)")
    parser.add_argument("--b", required=True, help="the other device's results of the same config")
    parser.add_argument("--a-device", required=True, help="what ran a, e.g. 'cpu (2-core EPYC)'")
    parser.add_argument("--b-device", required=True, help="what ran b, e.g. 'h100'")
    parser.add_argument("--output", default="benchmarks/results/device_floor.json")
    args = parser.parse_args(argv)
    try:
        result = compare(json.loads(Path(args.a).read_text()), json.loads(Path(args.b).read_text()),
                         (args.a, args.b))
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not result["pairs"]:
        print(f"error: {args.a} and {args.b} share no trained cell: are they results of the same grid?",
              file=sys.stderr)
        return 2
    result = {"a": {"path": args.a, "device": args.a_device}, "b": {"path": args.b, "device": args.b_device},
              "differences": "b minus a; accuracy and ECE in points, NLL in nats", **result}
    try:
        write_result(args.output, result, echo=False)
    except OSError as e:
        print(f"error: cannot write {args.output}: {e}", file=sys.stderr)
        return 2
    for group in ("evaluation_only", "training_and_evaluation"):
        s = result[group]
        print(f"{group}: {s['pairs']} pairs" + "".join(
            f"; |{m}| max {s[m]['max_abs']:.3g} ({s[m]['max_at'] or '-'}), mean {s[m]['mean_abs']:.3g}"
            for m in METRICS if m in s))
    print(f"kept other steps: {len(result['other_steps'])}; written {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
