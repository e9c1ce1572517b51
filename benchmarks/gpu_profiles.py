"""The GPU measurements beyond the check, the one most needed first, within one time budget (``make gpu-profiles``):

    python -m benchmarks.gpu_profiles [--budget-s 300] [--each-s 120] [--results-dir benchmarks/results]
        [--only gpu_serve_profile,paper_scale_gpu_checkpointed,...]

A lent machine's time is short (15 minutes a session here, the check taking about 8 with its start-up), so the
profiles run in :data:`PROFILES`' order, which puts first what decides the issue's open bounds:

1. ``gpu_serve_profile``: where the service's time goes on CUDA (the bound, when the check's serve steps are under
   1,000 answers/s); it reads the calibration the check's calibrate step wrote (``runs/gpu_check/default-cuda``);
2. ``paper_scale_gpu_checkpointed``: the 8B shape with gradient checkpointing (the memory lever, when the check's
   paper step is over the paper's 21.88 GB);
3. ``service_bound``: the one-question answers/s one service process gives through HTTP on this machine's CPU when
   the trunk costs nothing (``benchmarks.service_bound``, a stand-in trunk, its client a process of its own, which
   the machine's 16 cores leave room for; the GPU is not used). Beside the check's one-question serve round it
   names the bound: near it, the host (the process's GIL: docs/results.md#service-bound); well above it, the card
   or the passes;
4. ``training_precision``: where a training step's time goes in fp32, bf16 and under autocast (why bf16 trained
   slower than fp32), at the check's micro-batch of 64;
5. ``merged_adapter``: what folding the adapter into the weights saves a forward;
6. ``padding_cost``: padded freely against length groups;
7. ``gradient_checkpointing``: its trade on the 135M model;
8. ``pass_overhead``: what a pass costs the machine's CPU besides the trunk, and the predictor's two cheaper steps;
9. ``check_threads``: whether 2 or 4 request-checking threads answer more than one outside the trunk, on the GPU
   machine's cores (``IBEDL_CHECK_THREADS``'s default there is 4).

Each runs as a process of its own (its group killed at its limit: ``benchmarks.gpu_check.run_budgeted``) for at
most ``--each-s`` seconds and what is left of ``--budget-s``; one that would start with less than
:data:`MIN_START_S` left is skipped. A failed one does not stop the next. Each writes its JSON into
``--results-dir`` (``$OUT`` on a lent machine: what a call has written comes back even when the call is cut short),
and ``gpu_profiles.json`` there records what each did: ``wrote``, ``stopped_by_budget`` (what it had written is kept),
``process_exit`` (it failed after writing part of its result), ``error`` (it wrote nothing: without CUDA each but
``service_bound`` exits 2 saying so) or ``skipped``, and its seconds. It exits 1 unless every profile wrote its whole
result.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from benchmarks.common import device_output, write_result
from benchmarks.gpu_check import run_budgeted

# name: (module, its arguments): in the order they run, the one most needed first (module docstring).
PROFILES = {
    "gpu_serve_profile": ("benchmarks.gpu_serve_profile", ["--artifact", "runs/gpu_check/default-cuda"]),
    "paper_scale_gpu_checkpointed": ("benchmarks.paper_scale_gpu", ["--gradient-checkpointing"]),
    "service_bound": ("benchmarks.service_bound", ["--requests", "3000"]),
    "training_precision": ("benchmarks.training_precision", ["--device", "cuda", "--batch-size", "64"]),
    "merged_adapter": ("benchmarks.merged_adapter", ["--device", "cuda"]),
    "padding_cost": ("benchmarks.padding_cost", ["--device", "cuda"]),
    "gradient_checkpointing": ("benchmarks.gradient_checkpointing", ["--device", "cuda"]),
    "pass_overhead": ("benchmarks.pass_overhead", ["--device", "cuda"]),
    "check_threads": ("benchmarks.check_threads", ["--device", "cuda", "--threads", "1,2,4"]),
}
# A profile is not started with less time than this left of the budget: loading a model and CUDA take most of it.
MIN_START_S = 30.0


# The profiles that write one file whatever the device; the others write benchmarks.common.device_output's for cuda.
OWN_OUTPUT = {"gpu_serve_profile": "gpu_serve_profile.json",
              "paper_scale_gpu_checkpointed": "paper_scale_gpu_checkpointed.json",
              "service_bound": "service_bound_gpu_host.json"}  # the host's CPU: no CUDA in it


def output_name(name: str) -> str:
    """The file a profile writes in the results folder (as its default output would be named)."""
    return OWN_OUTPUT.get(name) or Path(device_output(name, "cuda")).name


def run(names: list[str], results: Path, budget_s: float, each_s: float, python: str = sys.executable,
        clock=time.monotonic) -> dict:
    """Run the profiles ``names`` in :data:`PROFILES`' order within ``budget_s`` seconds, each for at most
    ``each_s``; their record (module docstring), written to ``results``/gpu_profiles.json after each."""
    if budget_s <= 0 or each_s <= 0:
        raise ValueError(f"budget_s and each_s must be > 0, got {budget_s} and {each_s}")
    record = {"budget_s": budget_s, "each_s": each_s, "profiles": {}}
    end = clock() + budget_s
    for name in (n for n in PROFILES if n in names):
        module, arguments = PROFILES[name]
        left = end - clock()
        if left < MIN_START_S:
            entry = {"skipped": f"{left:.0f} s of the budget left, under the {MIN_START_S:.0f} s a profile needs"}
        else:
            output = results / output_name(name)
            start = clock()
            outcome = run_budgeted([python, "-m", module, *arguments, "--output", str(output)], min(each_s, left),
                                   output)
            entry = {key: outcome[key] for key in ("error", "stopped_by_budget", "process_exit") if key in outcome}
            if output.is_file():  # a profile stopped by its limit keeps what it had written
                entry["wrote"] = str(output)
            entry["seconds"] = round(clock() - start, 1)
        record["profiles"][name] = entry
        write_result(results / "gpu_profiles.json", record, echo=False)
        print(f"{name}: {entry}", flush=True)
    return record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_profiles", description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-s", type=float, default=300.0, help="seconds for all of them (default 300)")
    parser.add_argument("--each-s", type=float, default=120.0, help="seconds one may run at most (default 120)")
    parser.add_argument("--results-dir", default="benchmarks/results",
                        help="where each writes its JSON, and gpu_profiles.json (default benchmarks/results)")
    parser.add_argument("--only", default=",".join(PROFILES),
                        help=f"comma-separated, run in the fixed order whatever the order given: {', '.join(PROFILES)}")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in PROFILES]
    if unknown or not names:
        parser.error(f"--only: unknown profiles {unknown}; choose among {', '.join(PROFILES)}" if unknown
                     else "--only: no profile named")
    if not (args.budget_s > 0 and args.each_s > 0):
        parser.error(f"--budget-s and --each-s must be > 0, got {args.budget_s} and {args.each_s}")
    record = run(names, Path(args.results_dir), args.budget_s, args.each_s)
    return 0 if all(set(e) == {"wrote", "seconds"} for e in record["profiles"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
