"""Whether more request-checking threads raise the service's bound outside the trunk:

    python -m benchmarks.check_threads [--artifact artifacts/default] [--device cpu] [--threads 1,2]
        [--clients 64] [--requests 384] [--rounds 8] [--dataset sciq]
        [--output benchmarks/results/check_threads_<cpu|cuda>.json]

Before a question is queued, the engine checks its request on a thread of its own (``IBEDL_CHECK_THREADS``): its
fields, then its prompt tokenised on that thread's copy of the tokenizer to count its tokens (the pass takes those
ids). On a CPU the trunk's forward bounds the service; on a GPU it answers faster than one thread tokenises, so the
check threads can be the bound (``pass_overhead``: 0.64-0.82 ms a one-question request on the 2-core EPYC). Here
one engine per thread count (``--threads``) serves the artifact's predictor (torch backend, on ``--device``), its
trunk replaced by a stand-in that returns states of the trunk's shape, so the time measured is everything but the
trunk's forward, under the settings a GPU serves with (passes of up to 64 questions, padded freely). Each round,
``--clients`` callers on the engine's event loop send ``--requests`` one-question requests through
``Engine.ask_one``, as the HTTP door does once it has parsed a body (no HTTP here: its parsing and the client's
work would share these cores), each the next distinct SciQ training question with its passage (or
``--dataset``'s), whole under the service's token limit; every engine answers the same questions in a round, the
engines' order alternating between rounds, and each a first untimed round. Recorded per thread count: answers/s and
the process's CPU seconds an answer; against one thread, the time ratio with a 95% paired bootstrap interval over
the rounds (below 1: faster), the CPU time an answer took on each kind of thread (check threads, model thread,
event loop: which one bounds), the largest difference between two engines' probabilities for one question (the
passes differ in size, so the head's arithmetic may differ in the last bits; a wrong prompt's ids would differ by
far more) and the CPU's features (the cores the threads share: with two, the model's thread, the event loop and
the check threads compete).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from benchmarks.common import (
    cpu_by_thread_kind,
    cpu_features,
    cuda_refusal,
    device_output,
    paired_ratio,
    parse_sizes,
    served_questions,
    write_result,
)

SERVE_AS_ON_A_GPU = {"max_batch_size": 64, "max_batch_tokens": 65536, "pad_freely": True}


STATES = 4096  # the stand-in's table of states


def stand_in_loader():
    """The engine's default loader, each predictor's trunk then replaced by a stand-in of its shape: a prompt's state
    is a row of a fixed random table picked by the sum of its token ids, so an answer depends on its own prompt
    only, not on the pass it ran in (host work does not depend on the values)."""
    import torch

    from ibedl.engine.runtime import load_predictors

    def load(settings):
        predictors = load_predictors(settings)
        for predictor in predictors:
            width = predictor.model.config.hidden_size
            table = torch.randn(STATES, width, generator=torch.Generator().manual_seed(0))
            table = table.to(predictor.device, next(predictor.heads[0].parameters()).dtype)

            def hidden(batch, table=table):
                return table[(batch.input_ids * batch.attention_mask).sum(1) % STATES]

            predictor._hidden = hidden
        return predictors

    return load


def cpu_by_role() -> dict[str, float]:
    """CPU seconds this process's threads have used, summed by role: the engines' check threads, model threads and
    event loops, the caller, and everything else (torch's workers, the tokenizers' pool)."""
    names = {"ibedl-check": "check", "ibedl-model": "model", "ibedl-engine": "event_loop", "MainThread": "caller"}
    out = dict.fromkeys([*names.values(), "other"], 0.0)
    for kind, seconds in cpu_by_thread_kind().items():
        out[names.get(kind, "other")] += seconds
    return out


def measured(n: int, first: int, seconds: dict[int, list[float]], cpu_s: list[float], roles: dict[str, float],
             requests: int) -> dict:
    """One thread count's record over the timed rounds so far: answers/s, CPU ms an answer (in all and by thread
    role) and, for all but the ``first`` count, its time against the first's (paired over the rounds; None after
    one round)."""
    answered = requests * len(seconds[n])
    paired = n != first and len(seconds[n]) >= 2
    return {"check_threads": n, "answers_per_s": answered / sum(seconds[n]),
            "cpu_ms_per_answer": 1e3 * sum(cpu_s) / answered,
            "cpu_ms_per_answer_by_thread": {role: 1e3 * used / answered for role, used in roles.items()},
            "time_vs_first": paired_ratio(seconds[n], seconds[first]) if paired else None}


async def burst(engine, requests: list, clients: int) -> tuple[float, list]:
    """Seconds for ``clients`` concurrent callers to have ``requests`` answered one request each, and the answers'
    probabilities in request order."""
    answers: list = [None] * len(requests)
    queue = iter(enumerate(requests))

    async def client() -> None:
        for i, request in queue:  # one shared queue: a caller sends its next request once answered
            answers[i] = (await engine.ask_one(request, engine.arrive())).probabilities

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return time.perf_counter() - start, answers


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.check_threads", description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", default="artifacts/default")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:i] (default cpu)")
    parser.add_argument("--threads", default="1,2", help="check threads to compare, comma-separated; the first is "
                        "the reference (default 1,2)")
    parser.add_argument("--clients", type=int, default=64, help="concurrent callers (default 64)")
    parser.add_argument("--requests", type=int, default=384, help="one-question requests a round (default 384)")
    parser.add_argument("--rounds", type=int, default=8, help="timed rounds of new questions (default 8; >= 2)")
    parser.add_argument("--dataset", default="sciq", help="a built-in dataset's training questions (default sciq)")
    parser.add_argument("--output", default=None, help="default: benchmarks/results/check_threads_<cpu|cuda>.json")
    args = parser.parse_args(argv)
    try:
        threads = parse_sizes(args.threads, "--threads")
    except ValueError as e:
        parser.error(str(e))
    if len(threads) < 2 or len(set(threads)) != len(threads):
        parser.error(f"--threads must list at least two distinct counts, got {args.threads!r}")
    for flag, value, least in (("--clients", args.clients, 1), ("--requests", args.requests, 1),
                               ("--rounds", args.rounds, 2)):
        if value < least:
            parser.error(f"{flag} must be >= {least}, got {value}")
    refused = cuda_refusal(parser, args.device)
    if refused is not None:
        return refused
    import torch

    from ibedl.engine.engine import Engine
    from ibedl.engine.schemas import PredictRequest
    from ibedl.engine.settings import EngineSettings

    engines = {}
    for n in threads:
        settings = EngineSettings(artifact=args.artifact, device=args.device, backend="torch",
                                  backend_switching=False, check_threads=n, **SERVE_AS_ON_A_GPU)
        engines[n] = Engine.load(settings, stand_in_loader())
    try:
        predictor = engines[threads[0]].runtimes[next(iter(engines[threads[0]].runtimes))].predictor
        limit = engines[threads[0]].settings.max_tokens
        try:
            questions = served_questions(predictor.tokenizer, predictor.template, limit, args.dataset,
                                         (args.rounds + 1) * args.requests, "fewer --rounds or --requests")
        except ValueError as e:
            parser.error(str(e))
        requests = [PredictRequest(question=q.question, options=list(q.options), context=q.context)
                    for q in questions]
        seconds: dict[int, list[float]] = {n: [] for n in threads}
        cpu_s: dict[int, list[float]] = {n: [] for n in threads}
        roles: dict[int, dict[str, float]] = {n: {} for n in threads}  # CPU seconds by thread role, timed rounds
        differs = 0.0  # the largest difference of an answer's probability between two engines
        output = args.output or device_output("check_threads", args.device)
        result = {"artifact": args.artifact, "dataset": args.dataset, "clients": args.clients,
                  "requests_per_round": args.requests, "rounds": 0, "settings": SERVE_AS_ON_A_GPU,
                  "device": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu",
                  "cpu": cpu_features(), "torch": torch.__version__}
        for r in range(args.rounds + 1):  # round 0: every engine's first use, untimed
            chunk = requests[r * args.requests:(r + 1) * args.requests]
            order = threads if r % 2 == 0 else threads[::-1]
            probs = {}
            for n in order:
                cpu, by_role = time.process_time(), cpu_by_role()
                took, probs[n] = engines[n].call(lambda n=n, chunk=chunk: burst(engines[n], chunk, args.clients))
                if r:
                    seconds[n].append(took)
                    cpu_s[n].append(time.process_time() - cpu)
                    for role, used in cpu_by_role().items():
                        roles[n][role] = roles[n].get(role, 0.0) + used - by_role.get(role, 0.0)
            differs = max(differs, *(abs(p[k] - q[k]) for n in threads[1:]
                                     for p, q in zip(probs[n], probs[threads[0]], strict=True) for k in q))
            if r:  # what the rounds so far measured, written after each (a run cut short keeps them)
                result["rounds"], result["largest_probability_difference"] = r, differs
                result["threads"] = [measured(n, threads[0], seconds, cpu_s[n], roles[n], args.requests)
                                     for n in threads]
                write_result(output, result, echo=r == args.rounds)
                print(f"round {r}: " + ", ".join(f"{n} threads {args.requests / seconds[n][-1]:.0f}/s"
                                                 for n in threads), flush=True)
    finally:
        for engine in engines.values():
            engine.close()
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
