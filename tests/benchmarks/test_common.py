"""The CPU every speed figure records: its model, instruction sets and oneDNN cap as ibedl.core.cpu_isa reads them,
and the cores this process may use; the context switches the service benchmarks count; the paired ratio of times."""

import os
from pathlib import Path

import pytest

import benchmarks.common as common


def test_the_record_is_cpu_isa_s_reading(monkeypatch):
    monkeypatch.setattr(common, "model_name", lambda: "Example CPU 9000")
    monkeypatch.setattr(common, "cpu_flags", lambda: {"fpu", "avx2", "avx512f", "avx512_vnni"})
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    cpu = common.cpu_features()
    assert cpu["model"] == "Example CPU 9000" and cpu["onednn_cap"] == "avx2"
    assert (cpu["avx2"], cpu["avx512f"], cpu["avx512_vnni"]) == (True, True, True)
    assert (cpu["avx512_bf16"], cpu["amx_bf16"], cpu["amx_int8"]) == (False, False, False)
    assert cpu["cores"] == len(os.sched_getaffinity(0))


def test_no_cap_is_recorded_as_none_and_cores_fall_back_off_linux(monkeypatch):
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    monkeypatch.delattr(os, "sched_getaffinity")
    cpu = common.cpu_features()
    assert cpu["onednn_cap"] is None and cpu["cores"] == os.cpu_count() and cpu["model"]



def asleep(pid: int) -> bool:
    """Whether process ``pid`` sleeps (state S in /proc/<pid>/stat): it has given up the CPU to wait."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2] == "S"


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux's /proc to count context switches")
def test_a_process_that_waits_counts_its_voluntary_context_switches():
    """A child that blocks on its stdin between 20 lines read one by one gives up the CPU each time. Each line is
    sent only once the child is seen asleep on the empty pipe: sent earlier, on a loaded machine, the child may find
    it before it sleeps, or be preempted on its way to sleep (counted as involuntary), and give up nothing. A child
    preempted right after it marked itself asleep still can: rare (40 of 40 trials here counted 20 or 21), so 15."""
    import subprocess
    import sys
    import time

    echo = "import sys\nfor line in sys.stdin:\n    print(line, end='', flush=True)\n"
    child = subprocess.Popen([sys.executable, "-c", echo], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdin is not None
        child.stdin.write("ready\n")
        child.stdin.flush()
        assert child.stdout.readline() == "ready\n"
        before = common.voluntary_context_switches(child.pid)
        for i in range(20):  # each line waits for the echo and for the child to sleep reading the next
            end = time.monotonic() + 30
            while not asleep(child.pid):
                assert time.monotonic() < end, "the child never blocked on its stdin"
            child.stdin.write(f"{i}\n")
            child.stdin.flush()
            assert child.stdout.readline() == f"{i}\n"
        assert common.voluntary_context_switches(child.pid) - before >= 15
    finally:
        child.stdin.close()
        child.wait(10)


def test_a_gpu_run_writes_beside_the_cpu_result_not_over_it():
    assert common.device_output("padding_cost", "cpu") == "benchmarks/results/padding_cost_cpu.json"
    assert common.device_output("merged_adapter", "cuda:1") == common.device_output("merged_adapter", "cuda") == (
        "benchmarks/results/merged_adapter_cuda.json")
    assert common.device_output("padding_cost", "mps") == "benchmarks/results/padding_cost_mps.json"


def test_the_paired_ratio_is_the_ratio_of_means_inside_its_interval():
    import numpy as np

    from benchmarks.common import paired_ratio

    rng = np.random.default_rng(1)
    bare = rng.uniform(0.4, 0.6, 40)
    slower = paired_ratio(1.6 * bare + rng.normal(0, 0.01, 40), bare)
    assert slower["ratio"] == pytest.approx(1.6, abs=0.01) and slower["low"] < slower["ratio"] < slower["high"]
    assert slower["high"] - slower["low"] < 0.03  # pairs cancel the questions' own spread (unpaired: about 0.15)
    level = paired_ratio(bare + rng.normal(0, 0.05, 40), bare)
    assert level["low"] < 1.0 < level["high"]
    assert paired_ratio([1.6, 1.6, 1.6], [0.4, 0.4, 0.4]) == {"ratio": pytest.approx(4.0), "low": None, "high": None}
    with pytest.raises(ValueError, match="paired times"):
        paired_ratio([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match=r"1-D .* shapes \(2, 2\)"):  # a table of times is not a pairing
        paired_ratio([[1.0, 2.0], [3.0, 4.0]], [[1.0, 2.0], [3.0, 4.0]])


def test_the_kept_activations_are_the_bytes_autograd_saves_weights_left_out_and_none_under_checkpointing():
    import torch
    from torch.utils.checkpoint import checkpoint

    from benchmarks.common import saved_activation_bytes

    module = torch.nn.Linear(1000, 1, bias=False)  # its weight: (1, 1000)
    w = module.weight[0]  # a view of the weight's storage
    x = torch.randn(1000, requires_grad=True)
    # exp saves its output (1,000 float32 = 4,000 bytes); x * w saves x (for w's gradient) and w (for x's), a weight
    kept, loss = saved_activation_bytes(lambda: (x * w).exp().sum(), module)
    assert kept == 4000 + 4000 and loss.requires_grad
    assert saved_activation_bytes(lambda: (x * w).exp().sum(), torch.nn.Linear(1, 1))[0] == 3 * 4000  # w counted
    # a checkpointed region keeps its inputs only (x; w is a weight) and recomputes the rest in the backward pass,
    # for the same gradient
    region = lambda a, b: (a * b).exp().sum()  # noqa: E731
    kept, loss = saved_activation_bytes(lambda: checkpoint(region, x, w, use_reentrant=False), module)
    assert kept == 4000
    loss.backward()
    torch.testing.assert_close(module.weight.grad[0], (x * (x * w).exp()).detach())


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux's /proc to read threads' CPU time")
def test_a_thread_s_cpu_seconds_are_read_by_its_native_id():
    """A thread that computes until its own clock (time.thread_time) says 0.3 s is read at about that, within the
    clock tick /proc counts in; a thread that only waited meanwhile is read at (nearly) nothing more than before."""
    import threading
    import time

    done, release, native = threading.Event(), threading.Event(), {}

    def spin() -> None:
        native["id"] = threading.get_native_id()
        while time.thread_time() < 0.3:
            pass
        done.set()
        release.wait(60)  # alive until read: an ended thread is no longer listed

    waiting = threading.Thread(target=release.wait, args=(60,))
    waiting.start()
    before = common.thread_cpu_s()
    worker = threading.Thread(target=spin)
    worker.start()
    try:
        assert done.wait(60), "the spinning thread never reached 0.3 s of CPU"
        used = common.thread_cpu_s()
    finally:
        release.set()
        worker.join()
        waiting.join()
    tick = 1 / os.sysconf("SC_CLK_TCK")
    assert 0.3 - 2 * tick <= used[native["id"]] <= 0.3 + 0.1  # + what it took to start and to stop spinning
    assert used[waiting.native_id] - before[waiting.native_id] <= 2 * tick
