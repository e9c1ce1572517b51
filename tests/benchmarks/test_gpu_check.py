"""make gpu-check (benchmarks/gpu_check.py) refuses a machine without CUDA at once, saying why; its steps, counts and
budgets are checked before anything runs, and a step past its budget is stopped with what it wrote kept. The check
itself needs a lent GPU machine and never runs in CI."""

import json
import sys
import time

import pytest
import torch

from benchmarks import gpu_check


def test_without_cuda_it_exits_2_saying_why(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--output", str(tmp_path / "out.json")]) == 2
    err = capsys.readouterr().err
    assert "make gpu-check needs a GPU: no CUDA device" in err and "CI never runs it" in err
    assert not (tmp_path / "out.json").exists()


def test_unknown_steps_are_refused_by_name(capsys):
    with pytest.raises(SystemExit) as exit_:
        gpu_check.main(["--only", "train,warp"])
    assert exit_.value.code == 2 and "unknown steps ['warp']" in capsys.readouterr().err


def test_the_makefile_has_the_target():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "Makefile").read_text()
    assert "gpu-check: setup-gpu" in text  # the GPU lock's venv (tests/test_lock.py checks the install)
    assert "$(GPU_VENV)/bin/python -m benchmarks.gpu_check" in text


def test_the_budgets_fit_the_whole_check_in_8_minutes():
    assert set(gpu_check.BUDGETS) == set(gpu_check.STEPS)
    assert sum(gpu_check.BUDGETS.values()) + 30 <= gpu_check.WHOLE_CHECK_S == 8 * 60  # 30 s for the parent


def test_budgets_given_on_the_command_line_replace_the_defaults_and_bad_ones_are_refused_by_name(capsys):
    assert gpu_check.parse_budgets("train=300, paper=45.5") == {**gpu_check.BUDGETS, "train": 300.0, "paper": 45.5}
    assert gpu_check.parse_budgets(None) == gpu_check.BUDGETS
    for text, message in (("warp=3", "unknown step 'warp'"), ("serve=soon", "serve must be a number of seconds, "
                          "got 'soon'"), ("train=0", "train must be > 0 seconds, got '0'")):
        with pytest.raises(ValueError, match=message):
            gpu_check.parse_budgets(text)
    with pytest.raises(SystemExit) as exit_:
        gpu_check.main(["--budget", "calibrate=-1"])
    assert exit_.value.code == 2 and "calibrate must be > 0 seconds, got '-1'" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--steps", "--batch-size", "--requests", "--clients", "--batch-items",
                                  "--batch-tokens"])
def test_counts_below_one_are_refused_by_name(flag, capsys):
    with pytest.raises(SystemExit) as exit_:
        gpu_check.main([flag, "0"])
    assert exit_.value.code == 2 and f"{flag} must be >= 1, got 0" in capsys.readouterr().err


def child(code: str) -> list[str]:
    """A step's child process that runs ``code``."""
    return [sys.executable, "-c", code]


def test_a_step_past_its_budget_is_killed_and_keeps_what_it_wrote(tmp_path):
    partial = tmp_path / "check_train.json"
    started = time.perf_counter()
    result = gpu_check.run_budgeted(child(
        f"import json, pathlib, time; pathlib.Path({str(partial)!r}).write_text(json.dumps({{'runs': {{'fp32': 1}}}}));"
        " time.sleep(60)"), 3, partial)
    assert time.perf_counter() - started < 30
    assert result == {"runs": {"fp32": 1}, "stopped_by_budget": 3}


def test_a_step_within_its_budget_gives_its_result_and_one_that_wrote_nothing_an_error(tmp_path):
    partial = tmp_path / "check_serve.json"
    partial.write_text('{"stale": true}')  # an earlier run's: removed before the step starts
    code = f"import json, pathlib; pathlib.Path({str(partial)!r}).write_text(json.dumps({{'ok': 256}}))"
    assert gpu_check.run_budgeted(child(code), 30, partial) == {"ok": 256}
    assert gpu_check.run_budgeted(child("raise SystemExit(3)"), 30, partial) == {
        "error": f"the step's process exited 3 without writing {partial}"}
    crash = f"import pathlib; pathlib.Path({str(partial)!r}).write_text('{{\"size_1\": 2}}'); raise SystemExit(1)"
    assert gpu_check.run_budgeted(child(crash), 30, partial) == {"size_1": 2, "process_exit": 1}  # failed midway
    with pytest.raises(ValueError, match="budget_s must be > 0, got 0"):
        gpu_check.run_budgeted(child("pass"), 0, partial)


def test_a_child_runs_its_one_step_and_records_its_failure(tmp_path, monkeypatch):
    def broken(args, out):
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(gpu_check, "step_calibrate", broken)
    out = tmp_path / "check.json"
    assert gpu_check.main(["--run-step", "calibrate", "--output", str(out)]) == 0
    assert json.loads((tmp_path / "check_calibrate.json").read_text()) == {
        "error": "RuntimeError: CUDA error: out of memory"}
    assert not out.exists()


def test_without_bitsandbytes_the_check_calibrates_bf16_and_merged_trunks_for_auto_and_says_nf4_was_not_measured():
    """Either way the graphed trunk is calibrated too, for auto to time it."""
    with_nf4, without = gpu_check.arithmetic(True), gpu_check.arithmetic(False)
    assert with_nf4["keys"] == ["torch-cuda-nf4-bf16", "torch-cuda-graphs-bf16"] and with_nf4["calibrate_flags"] == [
        ["--dtype", "bfloat16", "--load-in-4bit"], ["--backend", "torch-cuda-graphs-bf16"]]
    assert with_nf4["serve_env"] == {"IBEDL_LOAD_IN_4BIT": "true"} and "nf4" not in with_nf4
    assert without["keys"] == ["torch-cuda-bf16", "torch-cuda-merged-bf16", "torch-cuda-graphs-bf16"]
    assert without["calibrate_flags"] == [["--dtype", "bfloat16"], ["--backend", "torch-cuda-merged-bf16"],
                                          ["--backend", "torch-cuda-graphs-bf16"]]
    assert without["serve_env"] == {} and "bitsandbytes is not installed" in without["nf4"]
    # the key a CUDA service looks its calibration up by, and the arguments that compute each
    from ibedl.core.backends.registry import REFERENCE, REGISTRY
    from ibedl.training.calibrate import build_parser

    torch_backend = REGISTRY[REFERENCE]
    assert with_nf4["keys"][0] == without["keys"][0].replace("cuda-", "cuda-nf4-") == torch_backend.calibration_key(
        "cuda", "bfloat16", load_in_4bit=True)  # the first is what torch as loaded computes, which serves at start
    for use in (with_nf4, without):  # each calibrate command computes the key it is listed for, on the GPU
        for key, flags in zip(use["keys"], use["calibrate_flags"], strict=True):
            args = build_parser().parse_args(["--artifact", "a", "--dataset", "sciq", "--device", "cuda", *flags])
            assert REGISTRY[args.backend or REFERENCE].calibration_key(
                args.device, args.dtype, args.load_in_4bit) == key


def test_the_cuda_calibration_follows_the_defaults_recipe():
    """make calibrate-default's CALIBRATE flags (less the backend's own): a CUDA service keeps the same promises,
    per option count, as the CPU backends."""
    import re
    import shlex

    from tests.test_lock import ROOT

    text = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^CALIBRATE = \$\(PY\) -m ibedl\.training\.calibrate (.*?)\n(?=\S)", text, flags=re.S | re.M)
    assert shlex.split(recipe.group(1).replace("\\\n", " ")) == gpu_check.CALIBRATION


def test_the_serve_summary_counts_answers_not_refusals_and_gives_their_latency_percentiles():
    answers = ([(200, t / 1000, None) for t in range(1, 101)] + [(503, 0.001, "overloaded")] * 3
               + [(500, 0.2, "model_error"), (0, 30.0, "ReadTimeout")])
    got = gpu_check.serve_summary(answers, seconds=2.0)
    assert got["requests"] == 105 and got["answered"] == 100 and got["answers_per_s"] == 50.0
    assert got["refused"] == {"overloaded": 3} and got["failed"] == {"model_error": 1, "ReadTimeout": 1}
    assert got["latency_ms"]["p50"] == pytest.approx(50.5) and got["latency_ms"]["p99"] == pytest.approx(99.01)
    assert gpu_check.serve_summary([(503, 0.1, "not_ready")], 1.0)["latency_ms"] is None
    # questions the step did not send before its budget: apart, not failures
    cut = gpu_check.serve_summary(answers + [None] * 7, seconds=2.0)
    assert cut["not_sent"] == 7 and cut["requests"] == 105 and cut["answered"] == 100 and got["not_sent"] == 0
    batched = gpu_check.serve_summary(answers, seconds=2.0, per_request=8)  # requests of 8: answers count questions
    assert batched["answered"] == 100 and batched["answers_per_s"] == 400.0 and batched["questions_per_request"] == 8
    assert batched["latency_ms"] == got["latency_ms"]  # a request's latency
    with pytest.raises(ValueError, match="seconds"):
        gpu_check.serve_summary(answers, 0)
    with pytest.raises(ValueError, match="per_request must be >= 1, got 0"):
        gpu_check.serve_summary(answers, 1.0, per_request=0)


def test_a_refusals_type_is_read_from_its_body_or_its_status():
    assert gpu_check.error_type(503, b'{"error": {"type": "overloaded", "message": "x"}}') == "overloaded"
    assert gpu_check.error_type(502, b"<html>bad gateway</html>") == "502"
    assert gpu_check.error_type(500, b'{"detail": "x"}') == "500"


def test_the_passes_between_two_readings_of_the_services_own_metrics():
    """What the serve steps record of the passes: read from the Prometheus text the service's metrics produce, the
    passes before the clients' (start-up, warm-up) taken away; a reading that failed is said, not raised."""
    from prometheus_client import generate_latest

    from ibedl.serve.metrics import Metrics

    metrics = Metrics()
    empty = gpu_check.pass_totals(generate_latest(metrics.registry).decode())
    assert gpu_check.passes_between(empty, empty) == {"count": 0, "mean_questions": None, "mean_forward_ms": None}
    metrics.batch_size.observe(1)  # the warm-up's pass
    metrics.forward_seconds.observe(5.0)
    before = gpu_check.pass_totals(generate_latest(metrics.registry).decode())
    for size, seconds in ((2, 0.1), (4, 0.2), (6, 0.3)):
        metrics.batch_size.observe(size)
        metrics.forward_seconds.observe(seconds)
    after = gpu_check.pass_totals(generate_latest(metrics.registry).decode())
    got = gpu_check.passes_between(before, after)
    assert got["count"] == 3 and got["mean_questions"] == pytest.approx(4.0)
    assert got["mean_forward_ms"] == pytest.approx(200.0)
    assert gpu_check.passes_between(before, "HTTPStatusError: 401") == {"error": "HTTPStatusError: 401"}


def test_the_serve_rounds_send_one_question_requests_then_batches_of_other_questions():
    """The serve steps' two rounds against a real loopback HTTP server that counts each request as one pass in the
    service's own metrics: the first round's questions one a request, the second's (none of the first's) in whole
    batches, answers/s counting questions, each round's passes apart; past the sending time nothing is sent."""
    import asyncio
    import threading

    import httpx
    from prometheus_client import generate_latest

    from ibedl.serve.metrics import Metrics
    from tests.benchmarks.test_load_client import serve

    metrics, bodies = Metrics(), []

    async def handle(body):
        body = json.loads(body)
        bodies.append(body)
        metrics.batch_size.observe(len(body["items"]) if "items" in body else 1)
        metrics.forward_seconds.observe(0.01)
        return 200, b"{}"

    class Scraper:  # the step's httpx client, for /metrics
        def get(self, url):
            return httpx.Response(200, text=generate_latest(metrics.registry).decode(),
                                  request=httpx.Request("GET", url))

    loop = asyncio.new_event_loop()
    started, stop = threading.Event(), asyncio.Event()
    port = []

    async def run():
        server, p = await serve(handle)
        port.append(p)
        started.set()
        async with server:
            await stop.wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(run(),), daemon=True)
    thread.start()
    assert started.wait(10)
    items = [{"question": f"q{i}", "options": ["a", "b"]} for i in range(20)]
    try:
        got = gpu_check.client_rounds(Scraper(), "http://127.0.0.1", port[0], items, [("one", 1), ("batched", 4)],
                                      clients=3, send_until=time.monotonic() + 60)
        late = gpu_check.client_rounds(Scraper(), "http://127.0.0.1", port[0], items, [("one", 1)], clients=3,
                                       send_until=time.monotonic() - 1)
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)
    singles, batches = [b for b in bodies if "items" not in b], [b for b in bodies if "items" in b]
    assert sorted(b["question"] for b in singles) == sorted(f"q{i}" for i in range(10))
    assert sorted(len(b["items"]) for b in batches) == [4, 4]  # q10-q17; q18 and q19 fill no whole request
    assert sorted(q["question"] for b in batches for q in b["items"]) == sorted(f"q{i}" for i in range(10, 18))
    one, batched = got["one"], got["batched"]
    assert one["answered"] == 10 and one["questions_per_request"] == 1
    assert one["answers_per_s"] == pytest.approx(10 / one["seconds"])
    assert batched["requests"] == batched["answered"] == 2 and batched["questions_per_request"] == 4
    assert batched["answers_per_s"] == pytest.approx(8 / batched["seconds"])
    assert one["passes"]["count"] == 10 and one["passes"]["mean_questions"] == pytest.approx(1.0)
    assert batched["passes"]["count"] == 2 and batched["passes"]["mean_questions"] == pytest.approx(4.0)
    assert late["one"]["not_sent"] == 20 and late["one"]["answered"] == 0 and len(bodies) == 12


def test_a_metrics_reading_that_fails_says_why():
    class Refusing:
        def get(self, url):
            import httpx

            request = httpx.Request("GET", url)
            return httpx.Response(401, request=request)

    assert gpu_check.read_passes(Refusing(), "http://127.0.0.1:1").startswith("HTTPStatusError")


def test_the_serve_step_waits_for_autos_measurement_to_end_but_not_past_its_time():
    """The clients start once the background measurement is done or failed (one backend answers them), or at the
    deadline with the card as it stands; a service with nothing to measure starts them at once."""
    def service(states):
        cards = iter([{"backend": {"name": name, "background": None if state is None else {"state": state}}}
                      for name, state in states])
        return lambda: next(cards)

    now, waits = [0.0], []

    def wait(seconds):
        waits.append(seconds)
        now[0] += seconds

    states = [("torch", "waiting"), ("torch", "timing torch-cuda-merged-bf16"), ("torch-cuda-merged-bf16", "done")]
    card, ended = gpu_check.settled_card(service(states), until=10.0, clock=lambda: now[0], wait=wait)
    assert ended and card["backend"]["name"] == "torch-cuda-merged-bf16" and waits == [gpu_check.SETTLE_POLL_S] * 2
    card, ended = gpu_check.settled_card(service([("torch", "failed")]), until=0.0, clock=lambda: now[0], wait=wait)
    assert ended and card["backend"]["name"] == "torch"
    card, ended = gpu_check.settled_card(service([("torch", None)]), until=0.0, clock=lambda: now[0], wait=wait)
    assert ended  # a named backend: nothing measured in the background
    now[0], waits[:] = 0.0, []
    card, ended = gpu_check.settled_card(service([("torch", "building x")] * 3), until=0.6, clock=lambda: now[0],
                                         wait=wait)
    assert not ended and card["backend"]["background"]["state"] == "building x" and len(waits) == 2
    # a card the service did not give in time is asked again; past the deadline the last one read is kept
    cards = iter([None, {"backend": {"name": "torch", "background": {"state": "timing y"}}}, None])
    now[0], waits[:] = 0.0, []
    card, ended = gpu_check.settled_card(lambda: next(cards), until=0.6, clock=lambda: now[0], wait=wait)
    assert not ended and card["backend"]["background"]["state"] == "timing y" and len(waits) == 2
    now[0] = 0.0  # a service that stopped answering: no card by the deadline
    with pytest.raises(TimeoutError, match="gave no card"):
        gpu_check.settled_card(lambda: None, until=1.0, clock=lambda: now[0], wait=wait)


def test_the_second_serve_step_lifts_the_length_rules(monkeypatch, tmp_path):
    """serve_free runs the serve step with pad_freely (the step sets IBEDL_PAD_FREELY from it)."""
    seen = {}

    def fake(args, out, pad_freely=False):
        seen["pad_freely"] = pad_freely
        return {"pad_freely": pad_freely}

    monkeypatch.setattr(gpu_check, "step_serve", fake)
    args = gpu_check.argparse.Namespace(budget=None)
    monkeypatch.chdir(tmp_path)
    assert gpu_check.run_step("serve_free", args, tmp_path / "check.json") == 0
    assert seen == {"pad_freely": True}
    assert json.loads((tmp_path / "check_serve_free.json").read_text()) == {"pad_freely": True}


@pytest.mark.integration
def test_the_paper_step_measures_the_papers_workload(monkeypatch, tmp_path):
    """The paper step runs benchmarks.paper_scale_gpu on OBQA in batches of 4, what the paper's figures were measured
    on (here in its CPU smoke mode: the step's own arguments, with --smoke and two steps added)."""
    from benchmarks import paper_scale_gpu
    from tests.conftest import shared_cache_dir

    monkeypatch.setenv("IBEDL_CACHE_DIR", shared_cache_dir())
    real = paper_scale_gpu.main
    monkeypatch.setattr(paper_scale_gpu, "main", lambda argv: real([*argv, "--smoke", "--steps", "2"]))
    result = gpu_check.step_paper(gpu_check.argparse.Namespace(), tmp_path / "check.json")
    assert result["exit"] == 0 and result["device"] == "cpu (smoke)"
    assert result["vs_paper"]["same_workload"] is False  # the smoke model on a CPU: on a GPU the whole model
    run = result["paper_scale_gpu"]
    assert run["questions"] == "obqa train" and run["batch_size"] == 4 and run["paper_workload"]["dataset"] == "obqa"
    assert json.loads((tmp_path / "check_paper.json").read_text()) == run



def test_the_calibrate_step_keeps_each_arithmetic_done_should_its_budget_stop_the_next(monkeypatch, tmp_path):
    """Three arithmetics in 100 s: the step wrote nothing until all were done, so one stopped by its budget kept no
    seconds at all. Killed during the second (here: interrupted), the first's are in its partial file."""
    from ibedl.training import calibrate

    calls = []

    def calibrated(argv):
        calls.append(argv)
        if len(calls) == 2:
            raise KeyboardInterrupt  # what the budget's kill looks like from inside: nothing after it runs
        return 0

    monkeypatch.setattr(gpu_check, "RUNS", tmp_path / "runs")
    monkeypatch.setattr(calibrate, "main", calibrated)
    out = tmp_path / "gpu_check.json"
    args = type("Args", (), {"artifact": "artifacts/default"})()
    with pytest.raises(KeyboardInterrupt):
        gpu_check.step_calibrate(args, out)
    kept = json.loads(gpu_check.partial_path(out, "calibrate").read_text())
    first = gpu_check.arithmetic(gpu_check.nf4_available())["keys"][0]
    assert kept["done"] == [first] and set(kept["seconds_each"]) == {first} and len(kept["arithmetics"]) >= 2
