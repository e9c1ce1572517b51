"""The grid's hyper-parameter search: each candidate trained once on one seed, chosen by validation NLL.

    python -m benchmarks.hparam_search --config benchmarks/sciq_grid.yaml [--jobs 2] [--only-methods ib_edl]

The config's ``search`` section names a seed and, per method, candidate overrides of its training run (dotted keys as
``ibedl.training.finetune`` takes them: ``optim.head_lr``, ``method_params.beta``, ...). Every candidate trains as the
grid's runs do (same data sizes, warm start, early stopping) into ``runs/search/<name>/``; the criterion is the
validation NLL of the state early stopping kept (before calibration or a predictive fit), read from the run's manifest.
The test split is never read. Results (every candidate's start and end validation metrics, the choice per method) go to
``benchmarks/results/<name>_search.json``; the grid's ``method_params`` and ``method_train`` sections are then set from
the choices by hand, with this file as the evidence; once they are, the grid's cells of the search seed adopt the chosen
candidate's run rather than train it again (ibedl.training.experiments.benchmark.search_twin: same training config).
Candidates already in that file with the same overrides are not trained again: the command resumes, also on a fresh
machine.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import threading
from pathlib import Path

from ibedl.core.artifact import atomic_write_text
from ibedl.core.paths import check_writable
from ibedl.training.experiments.benchmark import (
    SEARCH_ROOT,
    Run,
    check_selection,
    config_differences,
    load_benchmark_config,
    run_child,
    search_results,
    train_overrides,
)
from ibedl.training.methods import get_method

log = logging.getLogger("benchmarks.hparam_search")


def candidates(config: dict) -> list[tuple[str, int, dict]]:
    """(method, index, overrides) of every candidate in the config's ``search`` section."""
    search = config.get("search")
    if not search or not search.get("candidates"):
        raise ValueError("the config has no search.candidates section")
    out = []
    for method, options in search["candidates"].items():
        get_method(method)  # an unknown method is an error naming the known ones
        if not isinstance(options, list) or not options:
            raise ValueError(f"search.candidates.{method} must be a non-empty list of overrides, got {options!r}")
        for i, overrides in enumerate(options):
            if not isinstance(overrides, dict):
                raise ValueError(f"search.candidates.{method}[{i}] must be a mapping of dotted keys, got {overrides!r}")
            out.append((method, i, overrides))
    return out


def train_candidate(config: dict, root: Path, method: str, index: int, overrides: dict, threads: int | None) -> dict:
    """Train one candidate (unless a run of its very config is there: a candidate edited since trains again, where
    its new overrides were filed beside the old run's metrics) and return its record."""
    search = config["search"]
    dataset = search.get("dataset", "sciq")
    run = Run("search", "id", dataset, method, int(search.get("seed", 0)), (dataset,))
    out = root / f"{method}-{index}"
    extra = [f"{k}={json.dumps(v)}" for k, v in overrides.items()]
    args = [*train_overrides(config, run, method, out), *extra, f"name={out.name}"]
    if config_differences(out, args) != []:
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        cmd = [sys.executable, "-m", "ibedl.training.finetune", *args]
        log.info("training %s %s", out.name, overrides)
        info = run_child(cmd, out / "train.log", threads)
        if info["returncode"] != 0:
            raise RuntimeError(f"training {out.name} failed with {info['returncode']}; see {out / 'train.log'}")
    manifest = json.loads((out / "manifest.json").read_text())
    run_info = manifest["training"]["run"]
    members = run_info.get("members") or [run_info]
    return {"method": method, "index": index, "overrides": overrides, "run": str(out),
            "validation_start": members[0]["validation_start"], "validation_end": members[0]["validation_end"],
            "steps": members[0]["stopped_step"], "best_step": members[0]["best_step"],
            "budget_steps": members[0]["budget_steps"], "stopped_by": members[0]["stopped_by"]}


def choose(records: list[dict]) -> dict:
    """Per method, the candidate with the lowest validation NLL (the first listed wins a tie)."""
    chosen = {}
    for r in records:
        best = chosen.get(r["method"])
        if best is None or r["validation_end"]["nll"] < best["validation_end"]["nll"]:
            chosen[r["method"]] = r
    return {m: {"index": r["index"], "overrides": r["overrides"], "validation_nll": r["validation_end"]["nll"]}
            for m, r in chosen.items()}


def markdown_table(results: dict) -> str:
    """The search results file as a Markdown table: each candidate's overrides, validation accuracy, confidence, ECE
    and NLL at the start and at the kept state, steps run (best), the chosen ones in bold."""
    chosen = {(m, c["index"]) for m, c in results["chosen"].items()}
    lines = ["| Method | Candidate | Acc (%) | Confidence | ECE (%) | NLL | Steps run (best) |",
             "|---|---|---|---|---|---|---|"]
    for r in results["candidates"]:
        s, e = r["validation_start"], r["validation_end"]
        name = ", ".join(f"{k.split('.')[-1]} {v}" for k, v in r["overrides"].items())
        nll = f"{s['nll']:.4f} → {e['nll']:.4f}"
        nll = f"**{nll}**" if (r["method"], r["index"]) in chosen else nll
        lines.append(f"| {r['method']} | {name} | {100 * s['accuracy']:.0f} → {100 * e['accuracy']:.0f} | "
                     f"{s['mean_confidence']:.3f} → {e['mean_confidence']:.3f} | "
                     f"{100 * s['ece']:.1f} → {100 * e['ece']:.1f} | {nll} | {r['steps']} ({r['best_step']}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hparam_search", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="a benchmark config with a search section")
    parser.add_argument("--jobs", type=int, default=1, help="candidates side by side (default 1)")
    parser.add_argument("--only-methods", nargs="*", help="restrict to these methods")
    parser.add_argument("--output", help="results JSON (default benchmarks/results/<name>_search.json)")
    parser.add_argument("--table", action="store_true",
                        help="print the results file as a Markdown table; train nothing")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        config = load_benchmark_config(args.config)
        every = candidates(config)
        check_selection("--only-methods", args.only_methods, {c[0] for c in every}, "its search candidates")
        todo = [c for c in every if not args.only_methods or c[0] in args.only_methods]
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.jobs < 1:
        print(f"error: --jobs must be >= 1, got {args.jobs}", file=sys.stderr)
        return 2
    name = config.get("name", Path(args.config).stem)
    root = SEARCH_ROOT / name
    output = Path(args.output) if args.output else search_results(name)
    if not args.table:
        try:
            check_writable(output, "--output")  # before the training, not after it
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    if args.table:
        if not output.is_file():
            print(f"error: no search results at {output}", file=sys.stderr)
            return 2
        print(markdown_table(json.loads(output.read_text())))
        return 0
    threads = max(1, (os.cpu_count() or 1) // args.jobs) if args.jobs > 1 else None
    # Candidates already in the results file with the same overrides are not trained again (the file is committed,
    # so a fresh machine resumes the search where it stopped); the rest are trained.
    previous = json.loads(output.read_text())["candidates"] if output.is_file() else []
    wanted = {(m, i): o for m, i, o in todo}
    records = {(r["method"], r["index"]): r for r in previous
               if wanted.get((r["method"], r["index"])) == r["overrides"]}
    lock = threading.Lock()
    queue = [c for c in todo if (c[0], c[1]) not in records]

    def write() -> None:
        done = sorted(records.values(), key=lambda r: (r["method"], r["index"]))
        atomic_write_text(
            output,
            json.dumps(
                {
                    "config": args.config,
                    "seed": config["search"].get("seed", 0),
                    "criterion": "validation NLL of the state early stopping kept",
                    "command": "python -m benchmarks.hparam_search " + " ".join(argv or sys.argv[1:]),
                    "candidates": done,
                    "chosen": choose(done),
                },
                indent=1,
            )
            + "\n",
        )

    def worker() -> None:
        while True:
            with lock:
                if not queue:
                    return
                method, index, overrides = queue.pop(0)
            try:
                record = train_candidate(config, root, method, index, overrides, threads)
            except RuntimeError as e:
                log.error("%s", e)
                continue
            with lock:
                records[(method, index)] = record
                write()
                log.info(
                    "%s[%d] %s: validation NLL %.4f -> %.4f, ECE %.3f -> %.3f, %d steps (%s)",
                    method,
                    index,
                    overrides,
                    record["validation_start"]["nll"],
                    record["validation_end"]["nll"],
                    record["validation_start"]["ece"],
                    record["validation_end"]["ece"],
                    record["steps"],
                    record["stopped_by"],
                )

    threads_ = [threading.Thread(target=worker) for _ in range(min(args.jobs, len(queue)) or 1)]
    for t in threads_:
        t.start()
    for t in threads_:
        t.join()
    if records:
        write()
        print(json.dumps(choose(list(records.values())), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
