"""What torch's OpenMP workers cost between parallel regions, spinning (libgomp's default) or waiting passively:

    python -m benchmarks.omp_wait [--artifact artifacts/default] [--pairs 3] [--rounds 20] [--batch 8]
        [--dataset sciq] [--output benchmarks/results/omp_wait_cpu.json]

torch's CPU kernels run on an OpenMP pool (libgomp on Linux). With ``OMP_WAIT_POLICY`` unset, a worker keeps
spinning for a while after each parallel region, ready for the next: a full core for every worker. In a service whose
trunk runs elsewhere (a GPU) the model's thread runs only small CPU operations, each of which wakes the pool, and the
spinning workers take the cores the event loop and the check threads need (``benchmarks.service_bound``'s ``other:
native`` threads). Here the other side of the choice: the artifact's predictor (torch backend, CPU, the real trunk)
answering ``--rounds`` batches of ``--batch`` SciQ training questions with their passages (or ``--dataset``'s), in a
process of its own with ``OMP_WAIT_POLICY`` unset, then in one with ``PASSIVE`` (each pair alternates which goes
first; both answer the same batches). Recorded per batch: seconds and the process's CPU seconds (every thread); per
pair, the ratio PASSIVE / unset of the mean seconds and of the mean CPU seconds a batch (a pair is the unit: batches of
one process are not independent draws), their mean and range over the pairs (no interval: few pairs), each child's
policy as it saw it, and the CPU's features.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

from benchmarks.common import cpu_features, served_questions, write_result

POLICIES = ("unset", "PASSIVE")
CHILD_TIMEOUT_S = 1800  # a child that has not answered by then is stuck


def child(artifact: str, rounds: int, batch: int, dataset: str) -> dict:
    """In a process started with the policy under test: ``rounds`` timed batches (after one untimed), their seconds
    and the process's CPU seconds each."""
    import torch

    from ibedl.core.predictor import Predictor
    from ibedl.engine.settings import EngineSettings

    predictor = Predictor.from_artifact(artifact, device="cpu", backend="torch")
    predictor.max_tokens = EngineSettings.model_fields["max_tokens"].default  # what the service serves
    questions = served_questions(predictor.tokenizer, predictor.template, predictor.max_tokens, dataset,
                                 (rounds + 1) * batch, "fewer --rounds or a smaller --batch")
    batches = [questions[i:i + batch] for i in range(0, len(questions), batch)]
    seconds, cpu = [], []
    with torch.no_grad():
        predictor.predict(batches[0])  # the pool's threads start, the first-call costs are paid
        for questions in batches[1:]:
            start, used = time.perf_counter(), time.process_time()
            predictor.predict(questions)
            seconds.append(time.perf_counter() - start)
            cpu.append(time.process_time() - used)
    return {"seconds": seconds, "cpu_s": cpu, "threads": torch.get_num_threads(),
            "policy": os.environ.get("OMP_WAIT_POLICY")}


def run_child(policy: str, args) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy != "unset":
        env["OMP_WAIT_POLICY"] = policy
    try:
        done = subprocess.run([sys.executable, "-m", "benchmarks.omp_wait", "--child", "--artifact", args.artifact,
                               "--rounds", str(args.rounds), "--batch", str(args.batch), "--dataset", args.dataset],
                              env=env, capture_output=True, text=True, check=False, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"the {policy} child did not finish within {CHILD_TIMEOUT_S} s") from e
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"the {policy} child exited with {done.returncode} and no result: "
                           f"{done.stderr.strip()[-2000:]}")
    return json.loads(lines[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.omp_wait", description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", default="artifacts/default")
    parser.add_argument("--pairs", type=int, default=3, help="pairs of processes, alternating which goes first "
                        "(default 3)")
    parser.add_argument("--rounds", type=int, default=20, help="timed batches a process (default 20; >= 2)")
    parser.add_argument("--batch", type=int, default=8, help="questions a batch (default 8)")
    parser.add_argument("--dataset", default="sciq", help="a built-in dataset's training questions (default sciq)")
    parser.add_argument("--output", default="benchmarks/results/omp_wait_cpu.json")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for flag, value, least in (("--pairs", args.pairs, 1), ("--rounds", args.rounds, 2), ("--batch", args.batch, 1)):
        if value < least:
            parser.error(f"{flag} must be >= {least}, got {value}")
    if args.child:
        print(json.dumps(child(args.artifact, args.rounds, args.batch, args.dataset)))
        return 0
    runs: dict[str, list[dict]] = {policy: [] for policy in POLICIES}
    for pair in range(args.pairs):
        for policy in (POLICIES if pair % 2 == 0 else POLICIES[::-1]):
            try:
                runs[policy].append(run_child(policy, args))
            except (RuntimeError, ValueError) as e:
                print(f"error: {e}", file=sys.stderr)
                return 1
            print(f"pair {pair + 1}/{args.pairs}: {policy} done", file=sys.stderr)

    def pair_ratios(key: str) -> dict:
        ratios = [float(np.mean(passive[key]) / np.mean(spin[key]))
                  for passive, spin in zip(runs["PASSIVE"], runs["unset"], strict=True)]
        return {"pairs": ratios, "mean": float(np.mean(ratios)), "low": min(ratios), "high": max(ratios)}

    result = {"artifact": args.artifact, "dataset": args.dataset, "pairs": args.pairs, "rounds": args.rounds,
              "batch": args.batch, "device": "cpu", "cpu": cpu_features(),
              "torch_threads": sorted({run["threads"] for policy in POLICIES for run in runs[policy]}),
              "mean_ms_a_batch": {policy: 1e3 * float(np.mean([s for run in runs[policy] for s in run["seconds"]]))
                                  for policy in POLICIES},
              "passive_time_ratio": pair_ratios("seconds"), "passive_cpu_ratio": pair_ratios("cpu_s"),
              "runs": runs}
    write_result(args.output, result)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
