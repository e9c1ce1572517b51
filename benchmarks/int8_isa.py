"""Which int8 arithmetic the default's saved static int8 outputs were computed on: recompute the first N SciQ
validation questions on this CPU's int8 kernels (or those oneDNN's cap leaves, ONEDNN_MAX_CPU_ISA) and compare with
benchmarks/results/decision_scores/default-openvino-int8.json, and with the fp32 outputs for scale.

    python -m benchmarks.int8_isa [--questions 40]                         # this CPU
    ONEDNN_MAX_CPU_ISA=AVX2 python -m benchmarks.int8_isa [--questions 40] # as an AVX2-only CPU

Appends one record per run to benchmarks/results/int8_isa.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

SCORES = Path("benchmarks/results/decision_scores")
RESULT = Path("benchmarks/results/int8_isa.json")


def main(argv=None) -> int:
    from ibedl.core.cpu_isa import int8_isa, onednn_cap
    from ibedl.core.predictor import Predictor
    from ibedl.training.calibrate import raw_outputs
    from ibedl.training.data import load_dataset

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=40)
    args = parser.parse_args(argv)
    saved = json.loads((SCORES / "default-openvino-int8.json").read_text())
    stream = saved["streams"]["sciq_validation"]
    questions = load_dataset("sciq", "validation")
    if [q.answer for q in questions] != stream["labels"]:
        print("error: the saved outputs are not in the order of the SciQ validation split", file=sys.stderr)
        return 2
    predictor = Predictor.from_artifact("artifacts/default", backend="openvino-int8")
    predictor.max_tokens = saved["max_tokens"]
    _, raw = raw_outputs(predictor, questions[: args.questions], 8, progress=False)
    here, before = np.array(raw["alpha"]), np.array(stream["alpha"][: args.questions])
    fp32 = json.loads((SCORES / "default-openvino-fp32.json").read_text())["streams"]["sciq_validation"]
    record = {
        "command": "python -m benchmarks.int8_isa " + " ".join(argv if argv is not None else sys.argv[1:]),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "int8_isa": int8_isa(), "onednn_cap": onednn_cap(),
        "questions": args.questions,
        "max_abs_alpha_difference_to_saved_int8": float(np.abs(here - before).max()),
        "max_relative_alpha_difference_to_saved_int8": float((np.abs(here - before) / before).max()),
        "saved_int8_vs_fp32_max_abs_alpha_difference":
            float(np.abs(before - np.array(fp32["alpha"][: args.questions])).max()),
        "same_top_option": int((here.argmax(1) == before.argmax(1)).sum()),
    }
    runs = json.loads(RESULT.read_text())["runs"] if RESULT.is_file() else []
    RESULT.write_text(json.dumps({"note": __doc__.split("\n\n")[0], "runs": [*runs, record]}, indent=1) + "\n")
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
