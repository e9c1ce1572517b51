"""A grid's per-question predictions, kept compact beside its results so that every claim can be tested by a paired
bootstrap without the trained runs (benchmarks.grid_intervals).

    python -m benchmarks.grid_predictions --grid sciq_grid_shared_lr [--runs-dir runs/benchmark/<grid>]
        [--output benchmarks/results/<grid>.predictions.npz] [--replace]

The benchmark runner caches each (trained run, method, evaluation set)'s predictions as JSON beside the run
(``runs/benchmark/<grid>/<train key>/predictions-<method>-<set>.json``: tens of MB for a grid, not committed). This
writes them into one compressed ``.npz``, under keys ``<train key>|<method>|<set>|<field>``; the rows already in the
file of each (run, method, set) not collected here (trained in another checkout, on another machine) are kept,
unless ``--replace``:

- ``probs`` (N, C) float32: the served probabilities, NaN-padded where a question has fewer than C options;
- ``labels`` (N,) int8: the right option;
- ``uncertainty`` (N,) float32: the Dirichlet's uncertainty mass u (evidential methods only);
- ``probs0``, ``uncertainty0``: the same without the post-hoc step (IB-EDL at zeta = 0), where the run has one;
- ``sigma`` (N,) float32: IB-EDL's sigma averaged over each question's options.

float32 keeps every metric the grid reports to 1e-6 of the JSON's (tests/benchmarks/test_grid_predictions.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger("benchmarks.grid_predictions")

SEP = "|"
FIELDS = ("probs", "labels", "uncertainty", "probs0", "uncertainty0", "sigma")


def padded(rows: list) -> np.ndarray:
    """Rows of varying length as one (N, C_max) float32 array, NaN where a row is shorter."""
    if not rows:
        raise ValueError("no predictions to keep (an empty set)")
    out = np.full((len(rows), max(len(r) for r in rows)), np.nan, dtype=np.float32)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


def unpadded(probs: np.ndarray) -> list[np.ndarray]:
    """The (N, C) NaN-padded array back as N rows of their own lengths (float64)."""
    return [row[~np.isnan(row)].astype(np.float64) for row in probs]


def compact(cached: dict) -> dict[str, np.ndarray]:
    """The fields (``FIELDS``) of one cached predictions file (the runner's JSON)."""
    for key in ("probs", "labels"):
        if key not in cached:
            raise ValueError(f"a predictions file without {key!r}")
    if len(cached["probs"]) != len(cached["labels"]):
        raise ValueError(f"{len(cached['probs'])} probability rows for {len(cached['labels'])} labels")
    out = {"probs": padded(cached["probs"]), "labels": np.asarray(cached["labels"], dtype=np.int8)}
    if cached.get("uncertainty") is not None:
        out["uncertainty"] = np.asarray(cached["uncertainty"], dtype=np.float32)
    if cached.get("sigma") is not None:
        out["sigma"] = np.asarray(cached["sigma"], dtype=np.float32)
    bare = cached.get("without_posthoc")
    if bare is not None:
        out["probs0"] = padded(bare["probs"])
        if bare.get("uncertainty") is not None:
            out["uncertainty0"] = np.asarray(bare["uncertainty"], dtype=np.float32)
    return out


def cached_files(runs_dir: Path) -> list[tuple[str, str, str, Path]]:
    """(train key, method, set file name, path) of every cached predictions file under ``runs_dir``, sorted. The set's
    name in a file name has ``:`` written as ``-`` (``sciq-no_context``); :func:`collect` maps it back."""
    found = []
    for path in sorted(runs_dir.glob("*/predictions-*.json")):
        if path.name.endswith(".partial.json"):
            continue
        found.append((path.parent.name, path.name.removeprefix("predictions-").removesuffix(".json"), path))
    return [(train, *_method_and_set(rest), path) for train, rest, path in found]


def _method_and_set(rest: str) -> tuple[str, str]:
    """``<method>-<set>`` split at the method: method names have no ``-`` (``ib_edl``), sets may
    (``sciq-no_context``)."""
    method, _, dataset = rest.partition("-")
    if not dataset:
        raise ValueError(f"a predictions file name without a set: predictions-{rest}.json")
    return method, dataset


def collect(runs_dir: Path, eval_sets: list[str]) -> dict[str, np.ndarray]:
    """Every cached predictions file under ``runs_dir`` as the npz's arrays; ``eval_sets``: the grid's set names (with
    ``:``), to name each file's set as the results do."""
    names = {s.replace(":", "-"): s for s in eval_sets}
    arrays = {}
    for train, method, file_set, path in cached_files(runs_dir):
        dataset = names.get(file_set)
        if dataset is None:
            raise ValueError(f"{path}: set {file_set!r} is none of the grid's ({', '.join(eval_sets)})")
        for field, values in compact(json.loads(path.read_text())).items():
            arrays[SEP.join((train, method, dataset, field))] = values
    if not arrays:
        raise ValueError(f"no cached predictions under {runs_dir} (run the grid first)")
    return arrays


@dataclass
class GridPredictions:
    """A grid's kept predictions (:func:`load`), looked up by (train key, method, set)."""

    arrays: dict[str, np.ndarray]

    def seeds(self) -> set[int]:
        """The seeds of the trained runs whose predictions are kept (train keys end in ``-s<seed>``).

        Raises:
            ValueError: a key whose train key does not end in ``-s<seed>``.
        """
        out = set()
        for key in self.arrays:
            found = re.search(r"-s(\d+)$", key.split(SEP)[0])
            if found is None:
                raise ValueError(f"kept predictions under {key!r}: its train key does not end in -s<seed>")
            out.add(int(found.group(1)))
        return out

    def has(self, train_key: str, method: str, dataset: str) -> bool:
        return SEP.join((train_key, method, dataset, "probs")) in self.arrays

    def get(self, train_key: str, method: str, dataset: str, bare: bool = False) -> dict:
        """``probs`` (N rows, float64), ``labels`` (N,), ``uncertainty`` (N,) or None; ``bare``: without the post-hoc
        step (KeyError where the run has no such row)."""
        prefix = SEP.join((train_key, method, dataset)) + SEP
        if prefix + "probs" not in self.arrays:
            raise KeyError(f"no kept predictions for {train_key} {method} on {dataset}")
        suffix = "0" if bare else ""
        if bare and prefix + "probs0" not in self.arrays:
            raise KeyError(f"{train_key} {method} has no predictions without a post-hoc step")
        u = self.arrays.get(prefix + "uncertainty" + suffix)
        return {"probs": unpadded(self.arrays[prefix + "probs" + suffix]),
                "labels": self.arrays[prefix + "labels"].astype(np.int64),
                "uncertainty": None if u is None else u.astype(np.float64)}


def load(path: str | Path) -> GridPredictions:
    with np.load(path) as data:
        return GridPredictions({k: data[k] for k in data.files})


def beside(grid: GridPredictions, arm: GridPredictions) -> GridPredictions:
    """``grid``'s predictions with the rows of every method ``arm`` has replaced by ``arm``'s: an arm run on its own
    config beside a grid (e.g. IB-EDL as the paper specifies it beside the one-rate grid's other methods), so that
    its claims pair with the grid's rows question by question.

    The grid's rows of those methods that the arm lacks (a seed or set it has not run) are left out, not kept beside
    the arm's, and named in a warning: a claim then pools fewer seeds (grid_intervals records how many).

    Raises:
        ValueError: an arm set has no counterpart in the grid (the same kind of run, seed and set under another
            method), or its labels differ from the grid's there (other questions): no paired difference exists.
    """
    methods = {key.split(SEP)[1] for key in arm.arrays}
    others = {key.split(SEP)[1] for key in grid.arrays} - methods
    for key, labels in arm.arrays.items():
        train, method, dataset, field = key.split(SEP)
        if field != "labels":
            continue
        twins = [grid.arrays[k] for m in sorted(others)
                 if (k := SEP.join((train.replace(f"-{method}-", f"-{m}-"), m, dataset, "labels"))) in grid.arrays]
        if not twins:
            raise ValueError(f"the arm's {train} {method} on {dataset} has no counterpart in the grid")
        if any(len(t) != len(labels) or (t != labels).any() for t in twins):
            raise ValueError(f"the arm's {train} {method} answered other {dataset} questions than the grid's runs")
    kept = {k: v for k, v in grid.arrays.items() if k.split(SEP)[1] not in methods}
    dropped = sorted({cell(k) for k in grid.arrays.keys() - kept.keys() - arm.arrays.keys()})
    if dropped:
        log.warning("the arm has no rows for %d of the grid's (run, method, set): %s", len(dropped),
                    ", ".join(dropped))
    return GridPredictions({**kept, **arm.arrays})


def tagged(arm: GridPredictions, tag: str) -> GridPredictions:
    """``arm``'s rows under the method name ``<method>@<tag>``: kept beside a grid's rows of the same method, so that
    the two can be compared question by question (grid_intervals' head-to-head of an arm against the grid)."""
    if not tag or SEP in tag or "@" in tag:
        raise ValueError(f"a tag must be non-empty without {SEP!r} or '@', got {tag!r}")
    out = {}
    for key, value in arm.arrays.items():
        train, method, dataset, field = key.split(SEP)
        out[SEP.join((train, f"{method}@{tag}", dataset, field))] = value
    return GridPredictions(out)


def cell(key: str, parts: int = 3) -> str:
    """The first ``parts`` fields of an array's key (run, method, set) joined by spaces: ``"<run> <method> <set>"``."""
    return " ".join(key.split(SEP)[:parts])


def merged(kept: GridPredictions, fresh: dict[str, np.ndarray],
           eval_sets: list[str]) -> tuple[dict[str, np.ndarray], list[str]]:
    """``fresh`` arrays (:func:`collect`, this checkout's runs) over the ``kept`` file's: a (run, method, set) that
    ``fresh`` has takes all its fields from ``fresh``; the other (run, method, set)s stay as kept (runs trained in
    another checkout or on another machine, whose cached JSON is not here). Returns the arrays and the kept
    (run, method, set)s left as they were (:func:`cell`). A kept row of a run that also has fresh rows (another of its
    methods or sets) is named in a warning: the run's rows may come from two trainings of it.

    Raises:
        ValueError: a kept row's set is none of ``eval_sets`` (the grid's config changed): ``--replace`` drops them.
    """
    stray = sorted({cell(k) for k in kept.arrays if k.split(SEP)[2] not in eval_sets})
    if stray:
        raise ValueError(f"the kept file has rows for sets the grid no longer evaluates ({', '.join(stray)}); "
                         "--replace writes only this checkout's runs")
    renewed = {cell(k) for k in fresh}
    left = {k: v for k, v in kept.arrays.items() if cell(k) not in renewed}
    mixed = sorted({cell(k, 1) for k in left} & {cell(k, 1) for k in fresh})
    if mixed:
        log.warning("runs with rows both kept and collected here (two trainings of a run, if it was retrained): %s",
                    ", ".join(mixed))
    return {**left, **fresh}, sorted({cell(k) for k in left})


def default_path(grid: str) -> Path:
    return Path("benchmarks/results") / f"{grid}.predictions.npz"


def main(argv: list[str] | None = None) -> int:
    from ibedl.training.experiments.benchmark import expand, load_benchmark_config

    parser = argparse.ArgumentParser(prog="python -m benchmarks.grid_predictions", description=__doc__.split("\n\n")[0])
    parser.add_argument("--grid", required=True, help="the grid's name: benchmarks/<grid>.yaml")
    parser.add_argument("--runs-dir", help="its trained runs (default runs/benchmark/<grid>)")
    parser.add_argument("--output", help="default benchmarks/results/<grid>.predictions.npz; where it exists, its "
                        "rows of each (run, method, set) not collected from --runs-dir are kept (runs trained in "
                        "another checkout)")
    parser.add_argument("--replace", action="store_true",
                        help="write only the runs under --runs-dir, dropping the output's other rows")
    args = parser.parse_args(argv)
    try:
        config = load_benchmark_config(Path("benchmarks") / f"{args.grid}.yaml")
        sets = sorted({s for run in expand(config) for s in run.eval_sets})
        arrays = collect(Path(args.runs_dir or f"runs/benchmark/{args.grid}"), sets)
        output = Path(args.output) if args.output else default_path(args.grid)
        if output.suffix != ".npz":  # numpy would write OUTPUT.npz beside it and the size read below fail
            raise ValueError(f"--output {output} must end in .npz")
        fresh = {cell(k, 2) for k in arrays}
        left: list[str] = []
        if output.is_file() and not args.replace:
            try:
                arrays, left = merged(load(output), arrays, sets)
            except (zipfile.BadZipFile, EOFError) as e:
                raise ValueError(f"{output} is not a whole .npz ({e}): remove it, or pass --replace") from None
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_name(f".{output.stem}.partial.npz")  # renamed into place whole: never a torn output
    np.savez_compressed(partial, **arrays)
    partial.replace(output)
    runs = {cell(k, 2) for k in arrays}
    print(f"wrote {output} ({output.stat().st_size / 1e6:.2f} MB): {len(runs)} (run, method) pairs, {len(fresh)} "
          f"from {args.runs_dir or f'runs/benchmark/{args.grid}'}"
          + (f", {len(left)} (run, method, set)s kept from the file (not collected here)" if left else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
