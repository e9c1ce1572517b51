"""Run methods x datasets x seeds on one evaluation contract and write results, a report and plots.

    python -m ibedl.training.experiments.benchmark --config benchmarks/sciq_grid.yaml [--jobs N]
        ['seeds=[3]'] [--only-methods map ib_edl] [--only-kinds id ood] [--dry-run]

Experiments (each a list entry under ``experiments`` in the config):
    id     train on a dataset, evaluate on its test split (accuracy, ECE 10/15/25/35, NLL, Brier,
           selective prediction);
    ood    train on one dataset, evaluate on its test split and on other datasets' test splits;
           AUROC with in-distribution as the positive class, scores max probability (MP) and 1/u (UM), also
           with the option count matched; ``name:no_context`` is a dataset without its passage/article;
    noise  train with a fraction of training labels moved to another option; evaluate on clean test data.

Every run trains in a child process (so a crash costs one run and its peak memory is measured) into
``runs/benchmark/<name>/<run key>/``; a run whose artifact and predictions exist is not trained again,
so the command is safe to interrupt and resume; each finished cell is written to the results at once.
``--jobs N`` runs N chains of cells side by side (a chain: the cells that share one trained run), each child
process with cores / N threads. A method that ``reuses`` another's training run (MC-Dropout
and Laplace reuse MAP's, see ``ibedl.training.methods``) is evaluated on that run of the same key. Results go
to ``benchmarks/results/<name>.json`` (a list of runs), the report to ``benchmarks/results/<name>.md`` with PNG
plots beside it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from ibedl.core.artifact import atomic_write_text
from ibedl.core.cpu_isa import usable_cores
from ibedl.core.head import POSTHOC_KEYS
from ibedl.training import member_resume
from ibedl.training.config import apply_overrides, yaml_load
from ibedl.training.data import DATASETS
from ibedl.training.experiments.evaluate_run import limits_for, summarise_run, without_posthoc
from ibedl.training.experiments.report import write_report
from ibedl.training.methods import METHODS, get_method

log = logging.getLogger("ibedl.training.experiments.benchmark")

@dataclass(frozen=True)
class Run:
    """One (experiment, train dataset, method, seed) cell of the grid."""

    experiment: str
    kind: str
    dataset: str
    method: str
    seed: int
    eval_sets: tuple[str, ...]  # test datasets; the first is in-distribution
    label_noise: float = 0.0

    @property
    def key(self) -> str:
        noise = f"-noise{self.label_noise:g}" if self.label_noise else ""
        return f"{self.kind}-{self.dataset}{noise}-{self.method}-s{self.seed}"

    def train_key(self, method: str | None = None) -> str:
        """The trained run behind this cell: shared by id and ood cells of the same dataset."""
        noise = f"-noise{self.label_noise:g}" if self.label_noise else ""
        return f"{self.dataset}{noise}-{method or self.method}-s{self.seed}"


def load_benchmark_config(path: str | Path, overrides: list[str] = ()) -> dict:
    """A benchmark config, read from YAML. ``base: OTHER.yaml`` starts from another config (read the same way) and
    replaces its top-level keys, except ``method_params`` and ``method_train``, merged per method and key; ``search``
    is not inherited. Then ``key.sub=value`` overrides; a top-level ``seeds=[...]`` override is every experiment's
    seeds (an experiment's own ``seeds`` is the file's default for it, e.g. fewer seeds under noise)."""
    path = Path(path)
    try:
        config = yaml_load(path.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: invalid YAML: {e}") from e
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    if "base" in config:
        base = load_benchmark_config(Path(config.pop("base")))
        base.pop("search", None)
        merged = {**base, **config}
        for key in ("method_params", "method_train"):
            if key in config:
                merged[key] = {m: {**base.get(key, {}).get(m, {}), **config[key].get(m, {})}
                               for m in {**base.get(key, {}), **config[key]}}
        config = merged
    config = apply_overrides(config, list(overrides))
    unknown = sorted(set(config) - CONFIG_KEYS)
    if unknown:  # a typo ("size:") was silently ignored: a run on whole datasets
        raise ValueError(f"{path}: unknown keys {unknown}; a benchmark config has {sorted(CONFIG_KEYS)}")
    if any(item.split("=", 1)[0].strip() == "seeds" for item in overrides):
        for exp in config.get("experiments", []):
            exp.pop("seeds", None)
    return config


CONFIG_KEYS = frozenset({"name", "base", "methods", "seeds", "experiments", "train", "sizes", "method_params",
                         "method_train", "search"})


def expand(config: dict) -> list[Run]:
    """The grid of runs a benchmark config describes, in a stable order; ValueError naming an unknown method,
    experiment kind or dataset."""
    methods = [m for m in METHODS if m in config["methods"]]
    unknown = sorted(set(config["methods"]) - set(METHODS))
    if unknown:
        raise ValueError(f"unknown methods {unknown}; known: {list(METHODS)}")
    runs = []
    for exp in config["experiments"]:
        kind = exp["kind"]
        if kind == "id":
            cells = [(d, (d,), 0.0) for d in exp["datasets"]]
        elif kind == "ood":
            cells = [(exp["train"], (exp["train"], *exp["ood"]), 0.0)]
        elif kind == "noise":
            cells = [(d, (d,), float(exp.get("fraction", 0.3))) for d in exp["datasets"]]
        else:
            raise ValueError(f"experiment kind must be id, ood or noise, got {kind!r}")
        named = sorted({d for _, sets, _ in cells for d in sets if d.split(":")[0] not in DATASETS})  # name:variant
        if named:
            raise ValueError(f"experiment {exp.get('name', kind)!r}: unknown datasets {named}; known: "
                             f"{sorted(DATASETS)}")
        for dataset, eval_sets, noise in cells:
            for method in methods:
                for seed in exp.get("seeds", config["seeds"]):  # an experiment may run fewer seeds
                    runs.append(Run(exp.get("name", kind), kind, dataset, method, int(seed), eval_sets, noise))
    return runs


OVERRIDES_FIRST = "key=value overrides go before the --only-* options"


def check_selection(flag: str, wanted: list[str] | None, have: set[str], among: str, hint: str = "") -> None:
    """Refuse a ``--only-*`` value not in ``have`` (described as ``among``), rather than select nothing for it: a
    ``key=value`` override written after ``--only-kinds`` is otherwise read as a kind (argparse gives the option
    every word up to the next flag) and the run silently ignores it. ``hint``: added where a value has a ``=``."""
    unknown = sorted(set(wanted or ()) - have)
    if unknown:
        tail = f"; {hint}" if hint and any("=" in u for u in unknown) else ""
        raise ValueError(f"{flag}: {unknown} not among {among} ({sorted(have)}){tail}")


def restrict(runs: list[Run], methods: list[str] | None, kinds: list[str] | None) -> list[Run]:
    """The runs of ``methods`` and ``kinds`` (None or empty: all of them), each name checked against the runs."""
    check_selection("--only-methods", methods, {r.method for r in runs}, "this config's runs", OVERRIDES_FIRST)
    check_selection("--only-kinds", kinds, {r.kind for r in runs}, "this config's runs", OVERRIDES_FIRST)
    return [r for r in runs if (not methods or r.method in methods) and (not kinds or r.kind in kinds)]


RUN_DATA = ("train", "validation", "test", "label_noise", "noise_seed")  # the data keys each cell sets itself
# what an interrupted run's directory keeps for its next start: its log. finetune resumes an ensemble's saved members
# from where it staged them beside the directory (.NAME.partial); members and history.jsonl a run of an earlier
# release left here are kept, not resumed: such a run is trained again
KEPT_ON_RESTART = ("members", "history.jsonl", "train.log")
SEARCH_ROOT = Path("runs/search")  # benchmarks.hparam_search trains a config's candidates under SEARCH_ROOT/<name>/
UNCOMPARED = ("output", "name")  # what a search candidate and a grid cell may differ in and still be the same run


def train_overrides(config: dict, run: Run, method: str, out: Path) -> list[str]:
    """``ibedl.training.finetune`` overrides for the trained run behind ``run``. The config's ``train.data`` may add
    data keys the cell does not set (``disjoint_from``, ``subset_seed``); the cell's own (``RUN_DATA``) are refused
    there."""
    sizes = config.get("sizes", {})
    limits = {**sizes.get("default", {}), **sizes.get(run.dataset, {})}
    base = json.loads(json.dumps(config.get("train", {})))
    extra = base.pop("data", None) or {}
    if not isinstance(extra, dict) or set(extra) & set(RUN_DATA):
        raise ValueError(f"train.data may only add keys the grid does not set per cell (not {list(RUN_DATA)}), "
                         f"got {extra!r}")
    data = {
        **extra,
        "train": [{"dataset": run.dataset, "limit": limits.get("train")}],
        "validation": [{"dataset": run.dataset, "limit": limits.get("validation")}],
        "test": [],
        "label_noise": run.label_noise,
        "noise_seed": run.seed,
    }
    params = config.get("method_params", {}).get(method, {})
    pairs = {**base, "method": method, "seed": run.seed, "output": str(out), "name": run.train_key(method),
             "data": data, "progress": False}
    if params:
        pairs["method_params"] = params
    # an ensemble copies the members the grid's runs of the method they train as have trained (its first: MAP's run
    # of this seed, when trained with the same settings); finetune checks each one's fingerprint
    member_method = get_method(method).member_method
    donor = out.parent / run.train_key(member_method) if member_method else None
    if donor is not None and (donor / member_resume.RECORD).is_file():
        pairs["members_from"] = [str(donor)]
    # a method's own training settings (``method_train``: dotted keys, e.g. the head learning rate its search chose)
    own = config.get("method_train", {}).get(method, {})
    return [f"{k}={json.dumps(v)}" for k, v in pairs.items()] + [f"{k}={json.dumps(v)}" for k, v in own.items()]


def search_results(name: str) -> Path:
    """Where benchmarks.hparam_search writes a config's search: every candidate and the choice per method."""
    return Path("benchmarks/results") / f"{name}_search.json"


def config_differences(trained: Path, args: list[str]) -> list[str] | None:
    """The training config keys whose values differ between the run at ``trained`` (its manifest's) and the one
    finetune's overrides ``args`` make, but for what a run does not depend on (:data:`UNCOMPARED`): [] for the same
    run; None when ``trained`` holds no readable manifest."""
    from ibedl.training.config import TrainConfig, load_config

    try:
        got = TrainConfig(**json.loads((trained / "manifest.json").read_text())["training"]["config"]).to_dict()
    except (OSError, KeyError, ValueError, TypeError):
        return None
    want = load_config(None, args).to_dict()
    return sorted(k for k, v in want.items() if k not in UNCOMPARED and got.get(k) != v)


def search_twin(config: dict, run: Run, method: str, out: Path) -> Path | None:
    """The search's chosen candidate for ``method`` (``SEARCH_ROOT/<name>/<method>-<i>``, benchmarks.hparam_search,
    the choice read from :func:`search_results`) when its training config equals the cell's but for its output and
    name, or None: the grid adopts it rather than training the same run again. A config that does not (yet) name
    the choice trains its own runs."""
    search, name = config.get("search") or {}, config.get("name")
    if not search.get("candidates") or not name or run.seed != int(search.get("seed", 0)):
        return None
    try:
        chosen = json.loads(search_results(name).read_text())["chosen"][method]["index"]
    except (OSError, KeyError, ValueError):  # no search yet, or none chosen for the method
        return None
    candidate = SEARCH_ROOT / name / f"{method}-{chosen}"
    return candidate if config_differences(candidate, train_overrides(config, run, method, out)) == [] else None


def run_child(cmd: list[str], log_path: Path, threads: int | None = None) -> dict:
    """Run a command (with ``threads`` intra-op threads when given), returning its exit code, seconds and peak RSS
    (MiB) from wait4."""
    start = time.time()
    env = {**os.environ, "TQDM_DISABLE": "1"}
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    with open(log_path, "a") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
    code = os.waitstatus_to_exitcode(status)
    return {"returncode": code, "seconds": time.time() - start, "peak_rss_mib": usage.ru_maxrss / 1024}


class Runner:
    """Trains and evaluates the cells of a grid; ``threads`` intra-op threads per child process (None: torch's)."""

    def __init__(self, config: dict, root: Path, results_path: Path, dry_run: bool = False,
                 threads: int | None = None) -> None:
        self.config = config
        self.root = root
        self.results_path = results_path
        self.dry_run = dry_run
        self.threads = threads
        self.results = json.loads(results_path.read_text()) if results_path.is_file() else []
        self.lock = threading.Lock()  # results are shared by the --jobs worker threads
        self.sets_of: dict[tuple[str, str], tuple[str, ...]] = {}  # see plan()

    def plan(self, runs: list[Run]) -> None:
        """Evaluate each (trained run, method) once for all its cells: the first cell to need predictions draws
        them for every set any cell of that run and method reads (an id cell's and an ood cell's), in one process, so
        a predictive fit (Laplace's posterior) is made once per run rather than once per cell."""
        for run in runs:
            key = (run.train_key(get_method(run.method).trained_as), run.method)
            have = self.sets_of.get(key, ())
            self.sets_of[key] = have + tuple(d for d in run.eval_sets if d not in have)

    def stale(self, runs: list[Run]) -> dict[str, list[str]]:
        """The trained runs under the runs dir that ``runs`` would use or have used but that were trained under
        another config than the one given now: {run name: the keys that differ}. Their cells (in the results file)
        and the runs themselves were reused whatever the config said."""
        found = {}
        for run in runs:
            method = get_method(run.method).trained_as
            out = self.root / run.train_key(method)
            if out.name not in found and (differs := config_differences(out, train_overrides(self.config, run, method,
                                                                                             out))):
                found[out.name] = differs
        return found

    def done(self, run: Run) -> bool:
        with self.lock:
            return any(r["key"] == run.key for r in self.results)

    def add(self, record: dict) -> None:
        """Append a finished cell and write the results file at once (an interrupted grid resumes after it)."""
        with self.lock:
            self.results.append(record)
            self.results_path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.results_path, json.dumps(self.results, indent=1) + "\n")

    def ensure_trained(self, run: Run, method: str) -> tuple[Path, dict]:
        out = self.root / run.train_key(method)
        info_path = out / "benchmark-train.json"
        if (out / "manifest.json").is_file() and info_path.is_file():
            return out, json.loads(info_path.read_text())
        twin = search_twin(self.config, run, method, out)
        if self.dry_run:
            print(*(("train", out) if twin is None else ("adopt", out, "from", twin)))
            return out, {}
        if out.exists():  # an interrupted run: trained again, but for the ensemble members it had saved
            for child in out.iterdir():  # (finetune keeps those whose member.json matches: member_resume)
                if child.name in KEPT_ON_RESTART:
                    continue
                if child.is_dir():
                    shutil.rmtree(child)
                else:
                    child.unlink()
        if twin is not None:
            log.info("adopting %s: the search trained this run (%s)", out.name, twin)
            if out.exists():
                shutil.rmtree(out)
            shutil.copytree(twin, out)
            info = {"returncode": 0, "adopted_from": str(twin), "peak_rss_mib": None}
            atomic_write_text(info_path, json.dumps(info))
            return out, info
        out.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "ibedl.training.finetune", *train_overrides(self.config, run, method, out)]
        log.info("training %s", out.name)
        info = run_child(cmd, out / "train.log", self.threads)
        if info["returncode"] != 0:
            raise TrainingFailed(f"training {out.name} failed with {info['returncode']}; see {out / 'train.log'}")
        atomic_write_text(info_path, json.dumps(info))
        return out, info

    def evaluate(self, run: Run, artifact: Path) -> dict:
        """Predictions on every evaluation set, cached per (method, set) as JSON beside the artifact: an id and
        an ood cell of the same trained run share their in-distribution predictions."""
        def cache(dataset: str) -> Path:
            return artifact / f"predictions-{run.method}-{dataset.replace(':', '-')}.json"

        method = get_method(run.method)
        planned = self.sets_of.get((run.train_key(method.trained_as), run.method), ())
        wanted = run.eval_sets + tuple(d for d in planned if d not in run.eval_sets)
        limits = {d: limits_for(self.config.get("sizes", {}), d).get("test") for d in wanted}
        params = method.params(self.config.get("method_params", {}).get(run.method, {}))  # with the defaults

        def load(dataset: str) -> dict | None:  # the cached predictions, if drawn with this size and these parameters
            if not cache(dataset).is_file():
                return None
            found = json.loads(cache(dataset).read_text())
            try:
                same = method.params(found.get("method_params", params)) == params
            except ValueError:  # drawn with parameters the method no longer has
                return None
            # an IB-EDL set drawn before every one carried its zeta-free row (evaluate_run.zeta_free) is drawn again
            stale = POSTHOC_KEYS.get(method.head) == "zeta" and "without_posthoc" not in found
            return found if same and not stale and found.get("limit", limits[dataset]) == limits[dataset] else None

        sets = {d: load(d) for d in wanted}
        missing = [d for d, found in sets.items() if found is None]
        if missing and self.dry_run:
            print("evaluate", run.key, missing)
            return {}
        if missing:
            out_path = artifact / f"predictions-{run.method}.partial.json"
            cmd = [sys.executable, "-m", "ibedl.training.experiments.evaluate_run", "--artifact", str(artifact),
                   "--method", run.method,
                   "--output", str(out_path), "--limits", json.dumps(self.config.get("sizes", {})),
                   "--method-params", json.dumps(params), *[arg for d in missing for arg in ("--dataset", d)]]
            log_path = artifact / f"eval-{run.method}.log"
            info = run_child(cmd, log_path, self.threads)
            if info["returncode"] != 0:
                raise RuntimeError(f"evaluating {run.key} failed; see {log_path}")
            out = json.loads(out_path.read_text())
            for dataset, preds in out["sets"].items():
                sets[dataset] = {**preds, "limit": limits[dataset], "method_params": params,
                                 "eval_peak_rss_mib": info["peak_rss_mib"]}
                atomic_write_text(cache(dataset), json.dumps(sets[dataset]))
            out_path.unlink()
        sets = {d: sets[d] for d in run.eval_sets}
        return {"sets": sets, "eval_peak_rss_mib": max(s.get("eval_peak_rss_mib", 0) for s in sets.values())}

    def run(self, run: Run) -> dict | None:
        if self.done(run):
            return None
        artifact, train_info = self.ensure_trained(run, get_method(run.method).trained_as)
        preds = self.evaluate(run, artifact)
        if self.dry_run:
            return None
        manifest = json.loads((artifact / "manifest.json").read_text())
        train_run = manifest["training"]["run"]
        record = {
            "key": run.key, "experiment": run.experiment, "kind": run.kind, "method": run.method,
            "dataset": run.dataset, "seed": run.seed, "label_noise": run.label_noise,
            "metrics": summarise_run(preds, run.eval_sets),
            "metrics_without_posthoc": summarise_run(bare, run.eval_sets) if (bare := without_posthoc(preds)) else None,
            "efficiency": {
                "train_samples_per_s": train_run.get("samples_per_s"),
                "train_peak_rss_mib": train_info.get("peak_rss_mib"),
                "test_samples_per_s": preds["sets"][run.eval_sets[0]]["samples_per_s"],
                "eval_peak_rss_mib": preds.get("eval_peak_rss_mib"),
                # where each speed was measured (None: a run or cached prediction from before this was recorded)
                "train_machine": run_machine(train_run),
                "test_machine": preds["sets"][run.eval_sets[0]].get("machine"),
            },
        }
        if fits := predictive_fits(preds["sets"], run.eval_sets):
            record["posthoc"] = fits
        record["training"] = training_summary(manifest,
                                              validation_trajectory(artifact / "history.jsonl"))
        self.add(record)
        return record


def run_machine(train_run: dict) -> str | None:
    """The machine a run trained on, from its manifest's ``training.run`` (an ensemble's members' machines joined
    with " + " when they differ); None for a run trained before the machine was recorded."""
    machines = [m.get("machine") for m in train_run.get("members") or [train_run]]
    if None in machines:
        return None
    return " + ".join(dict.fromkeys(machines))


def validation_trajectory(history: Path) -> list[dict]:
    """The validation passes a run made while it trained (``eval_every``), from its ``history.jsonl``: per pass the
    member, the step and the validation metrics; [] for a run without any (or without a history)."""
    if not history.is_file():
        return []
    passes = []
    for line in history.read_text().splitlines():
        record = json.loads(line) if line.strip() else {}
        if record.get("validation"):
            passes.append({"member": record.get("member", 0), "step": record["step"], **record["validation"]})
    return passes


def training_summary(manifest: dict, trajectory: list[dict] | None = None) -> dict:
    """What training did to a cell's run, from its manifest: validation metrics at the start and the end (before
    calibration or a predictive fit; an ensemble's members' means), the steps run of the budget and what stopped them,
    and the calibration's post-hoc fit (IB-EDL's zeta) with the validation metrics after it, how many of its
    training questions its start had drawn (``start_overlap``; None for a run from before it was recorded), and
    the validation passes made while it trained (``trajectory``: :func:`validation_trajectory`; kept only when
    there are any)."""
    training = manifest.get("training") or {}
    run = training.get("run") or {}
    members = run.get("members") or [run]

    def mean_of(key: str) -> dict | None:
        values = [m[key] for m in members if m.get(key)]
        return {k: float(np.mean([v[k] for v in values])) for k in values[0]} if values else None

    return {
        "validation_start": mean_of("validation_start"), "validation_end": mean_of("validation_end"),
        "steps": [m.get("stopped_step", m.get("steps")) for m in members],
        "best_steps": [m.get("best_step") for m in members], "budget_steps": members[0].get("budget_steps"),
        "stopped_by": [m.get("stopped_by") for m in members],
        "zeta": training.get("zeta"), "validation_after_posthoc": (manifest.get("metrics") or {}).get("validation"),
        "start_overlap": training.get("start_overlap"),
        **({"trajectory": trajectory} if trajectory else {}),
    }


def predictive_fits(sets: dict, eval_sets) -> list[dict]:
    """The predictive fits behind a cell's predictions (Laplace: its prior precision and the fit's seconds), each with
    the sets it predicted. The id and ood cells of a trained run are evaluated in one process (Runner.plan), so both
    name the same fit; predictions cached by an earlier version of the runner may name two."""
    fits: list[dict] = []
    for dataset in eval_sets:
        info = sets[dataset].get("posthoc")
        if info is None:
            continue
        same = next((f for f in fits if {k: v for k, v in f.items() if k != "sets"} == info), None)
        if same is None:
            fits.append({**info, "sets": [dataset]})
        else:
            same["sets"].append(dataset)
    return fits


class TrainingFailed(RuntimeError):
    """A run's training child exited non-zero: every cell of its chain fails without training it again."""


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def run_grid(runner: Runner, todo: list[Run], jobs: int) -> list[str]:
    """Run the cells, ``jobs`` at a time; the keys of the cells that failed. Cells that share a trained run (the id
    and ood cells of one training, MC-Dropout and Laplace on MAP's) form one chain that a single worker runs in order;
    chains run side by side, seed by seed (for each seed the clean-label chains, then the label-noise ones). A failed
    cell, whatever failed (a worker died with the first unexpected error, and the grid then exited 0), is logged and
    the grid goes on; a failed training fails the rest of its chain without training it again."""
    from tqdm import tqdm

    runner.plan(todo)
    chains: dict[str, list[Run]] = {}
    for run in todo:
        chains.setdefault(run.train_key(get_method(run.method).trained_as), []).append(run)
    # Seed by seed: a grid stopped early has every method and experiment on its first seeds, not some methods on
    # all seeds and others on none.
    queue = sorted(chains.values(), key=lambda chain: (chain[0].seed, chain[0].label_noise > 0))
    bar = tqdm(total=len(todo), desc="benchmark", unit="run", dynamic_ncols=True)
    lock = threading.Lock()
    failed: list[str] = []

    def worker() -> None:
        while True:
            with lock:
                if not queue:
                    return
                chain = queue.pop(0)
            broken = None  # the training this chain shares, once it failed
            for run in chain:
                record, ok = None, broken is None
                if broken is not None:
                    log.error("%s: not run, its training failed (%s)", run.key, broken)
                else:
                    try:
                        record = runner.run(run)  # None: already done, or a dry run
                    except Exception as e:  # noqa: BLE001 - any cell's failure is reported, and the grid goes on
                        log.error("%s failed: %s: %s", run.key, type(e).__name__, e)
                        ok = False
                        if isinstance(e, TrainingFailed):
                            broken = str(e)
                with lock:
                    if not ok:
                        failed.append(run.key)
                    if record:
                        m = record["metrics"]
                        tqdm.write(f"{run.key}: acc {m['accuracy']:.3f} ece {m['ece']:.3f} nll {m['nll']:.3f}")
                    bar.update(1)

    threads = [threading.Thread(target=worker, name=f"job-{i}") for i in range(min(jobs, len(queue)) or 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bar.close()
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ibedl.training.experiments.benchmark",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--only-methods", nargs="*", help=f"run only these methods' cells ({OVERRIDES_FIRST})")
    parser.add_argument("--only-kinds", nargs="*", help="run only these experiment kinds (id, ood, noise)")
    parser.add_argument("--runs-dir", help="where trained runs go (default runs/benchmark/<name>)")
    parser.add_argument("--results", help="results JSON (default benchmarks/results/<name>.json)")
    parser.add_argument("--report-only", action="store_true", help="only (re)write the report from the results")
    parser.add_argument("--dry-run", action="store_true", help="list what would be trained and evaluated")
    parser.add_argument("--jobs", type=positive_int, default=1,
                        help="runs side by side, each in its own process with cores/jobs threads (default 1)")
    parser.add_argument("overrides", nargs="*",
                        help="key.sub=value overrides of the benchmark config, before any --only-* option "
                             "('seeds=[3]': every experiment's seeds)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        config = load_benchmark_config(args.config, args.overrides)
        runs = expand(config)
        todo = restrict(runs, args.only_methods, args.only_kinds)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    name = config.setdefault("name", Path(args.config).stem)  # also what search_twin looks under
    results = Path(args.results or f"benchmarks/results/{name}.json")
    threads = max(1, usable_cores() // args.jobs) if args.jobs > 1 else None  # the cores this process may use
    runner = Runner(config, Path(args.runs_dir or f"runs/benchmark/{name}"), results, args.dry_run, threads)
    stale = {} if args.report_only else runner.stale(todo)
    if stale:
        first, keys = next(iter(stale.items()))
        print(f"error: {len(stale)} trained runs under {runner.root} were trained under another config than this one "
              f"(first: {first}, which differs in {', '.join(keys)}), and their cells in {results} would be reused: "
              "give this config its own --runs-dir and --results, or remove those", file=sys.stderr)
        return 2
    failed = [] if args.report_only else run_grid(runner, todo, args.jobs)
    if not args.dry_run and runner.results:
        paths = write_report(runner.results, config, results.with_suffix(".md"), runner.root)
        print(f"wrote {results} and {', '.join(str(p) for p in paths)}")
    if failed:
        print(f"error: {len(failed)} of {len(todo)} cells failed (the log above says why): {', '.join(failed[:5])}"
              f"{', ...' if len(failed) > 5 else ''}; run the same command again to retry them", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
