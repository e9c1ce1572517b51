"""What a pass costs the model's thread besides the trunk's forward, and what the predictor's two cheaper steps save:

    python -m benchmarks.pass_overhead [--artifact artifacts/default] [--device cpu] [--sizes 1,8,64] [--rounds 16]
        [--dataset sciq] [--output benchmarks/results/pass_overhead_<cpu|cuda>.json]

A served pass runs on one thread: it tokenises its questions, makes its adapter the active one, runs the trunk, then
the head, and turns the outputs into answers. On a GPU all but the trunk's forward is host work no card speeds up
(the H200's serving profile: about 20 ms a pass outside the trunk, ``gpu_serve_profile.json``). Here the artifact's
predictor (torch backend, on ``--device``) answers distinct SciQ training questions with their passages (or
``--dataset``'s) as the service does: whole, under the service's default token limit (``IBEDL_MAX_TOKENS``; a
served prompt is never shortened, one over the limit refused), in passes of each size, its trunk replaced by a stand-in
that returns states of the trunk's shape (host work does not depend on their values), so a timed pass is everything
but the trunk's forward. Recorded per size, over ``--rounds`` rounds of new questions: milliseconds a pass and a
question, and, alternating which runs first, each of the three steps against what it replaced, on the same
questions: the pass's prompts tokenised in one call (``Predictor._encode_all``) against one call each; the adapter
activated only when another one is active (``Predictor.activate``) against PEFT's ``set_adapter`` before every
pass; and a pass of questions the service's request check tokenised already (``TokenizedQuestion``, their ids made
on a copy of the tokenizer, untimed: that is the check thread's work) against the same questions plain; each with a
95% paired bootstrap interval of the time ratio over the rounds (below 1: the step is cheaper), and the CPU's
features or the GPU's name.
"""

from __future__ import annotations

import argparse
import copy
import sys

from benchmarks.common import (
    cpu_features,
    cuda_refusal,
    device_output,
    paired_ratio,
    parse_sizes,
    served_questions,
    write_result,
)
from ibedl.core.auto_backend import time_call as timed


def measure(predictor, questions: list, size: int, rounds: int) -> dict:
    """One pass size: ``rounds`` passes of ``size`` new questions each (``questions`` holds at least
    ``rounds * size``), the three steps against what they replaced in each round."""
    from ibedl.core.predictor import TokenizedQuestion, prompt_ids

    name = predictor.members[0]
    counter = copy.deepcopy(predictor.tokenizer)  # the check thread's own copy
    passes, one_by_one, one_call, set_adapter, check, checked_passes = [], [], [], [], [], []
    for r in range(rounds):
        chunk = questions[r * size:(r + 1) * size]
        checked = [TokenizedQuestion.of(q, predictor.tokenizer, predictor.template,
                                        prompt_ids(counter, predictor.template, q)) for q in chunk]
        predictor.predict(chunk, False)  # the same questions once untimed: the tokenizer's and allocator's first use
        ways = [(passes, lambda chunk=chunk: predictor.predict(chunk, False)),
                (checked_passes, lambda checked=checked: predictor.predict(checked, False))]
        for times, call in ways if r % 2 == 0 else ways[::-1]:
            times.append(timed(call))
        ways = [(one_by_one, lambda chunk=chunk: [predictor._encode_one(i, q, True) for i, q in enumerate(chunk)]),
                (one_call, lambda chunk=chunk: predictor._encode_all(chunk, True))]
        for times, call in ways if r % 2 == 0 else ways[::-1]:
            times.append(timed(call))
        ways = [(set_adapter, lambda: predictor.model.set_adapter(name)), (check, lambda: predictor.activate(name))]
        for times, call in ways if r % 2 == 0 else ways[::-1]:
            times.append(timed(call))
    ms = lambda times: 1e3 * sum(times) / len(times)  # noqa: E731
    return {"questions_per_pass": size, "rounds": rounds,
            "pass_ms_outside_trunk": ms(passes), "question_ms_outside_trunk": ms(passes) / size,
            "checked_pass_ms_outside_trunk": ms(checked_passes),
            "checked_pass_vs_pass": paired_ratio(checked_passes, passes),
            "tokenise_one_by_one_ms": ms(one_by_one), "tokenise_one_call_ms": ms(one_call),
            "tokenise_one_call_vs_one_by_one": paired_ratio(one_call, one_by_one),
            "set_adapter_ms": ms(set_adapter), "activate_check_ms": ms(check),
            "activate_check_vs_set_adapter": paired_ratio(check, set_adapter)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.pass_overhead", description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", default="artifacts/default")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:i] (default cpu)")
    parser.add_argument("--sizes", default="1,8,64", help="questions per pass, comma-separated (default 1,8,64)")
    parser.add_argument("--rounds", type=int, default=16, help="passes of new questions per size (default 16; >= 2)")
    parser.add_argument("--dataset", default="sciq", help="a built-in dataset's training questions (default sciq)")
    parser.add_argument("--output", default=None, help="default: benchmarks/results/pass_overhead_<cpu|cuda>.json")
    args = parser.parse_args(argv)
    try:
        sizes = parse_sizes(args.sizes, "--sizes")
    except ValueError as e:
        parser.error(str(e))
    if args.rounds < 2:
        parser.error(f"--rounds must be >= 2 (a paired interval needs two rounds), got {args.rounds}")
    refused = cuda_refusal(parser, args.device)
    if refused is not None:
        return refused
    import torch

    from ibedl.core.predictor import Predictor
    from ibedl.engine.settings import EngineSettings

    predictor = Predictor.from_artifact(args.artifact, device=args.device, backend="torch")
    if not predictor.members:
        parser.error(f"--artifact {args.artifact}: its predictor serves no PEFT adapter to activate")
    width = predictor.model.config.hidden_size
    states = torch.randn(max(sizes), width, generator=torch.Generator().manual_seed(0))
    states = states.to(predictor.device, next(predictor.heads[0].parameters()).dtype)
    predictor._hidden = lambda batch: states[: batch.input_ids.shape[0]]  # the trunk's stand-in
    predictor.max_tokens = EngineSettings.model_fields["max_tokens"].default  # what make_runtimes sets
    try:
        questions = served_questions(predictor.tokenizer, predictor.template, predictor.max_tokens, args.dataset,
                                     args.rounds * max(sizes), "fewer --rounds, smaller --sizes")
    except ValueError as e:
        parser.error(str(e))
    result = {"artifact": args.artifact, "dataset": args.dataset, "device": (torch.cuda.get_device_name(args.device)
                                                   if args.device.startswith("cuda") else "cpu"),
              "cpu": cpu_features(), "torch": torch.__version__, "sizes": []}
    output = args.output or device_output("pass_overhead", args.device)
    for size in sizes:
        row = measure(predictor, questions, size, args.rounds)
        result["sizes"].append(row)
        write_result(output, result, echo=False)
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
