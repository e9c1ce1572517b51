"""The container's memory limit as cgroups v1 and v2 write it, and children the out-of-memory killer takes first."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ibedl.core.memory_limit import container_limit_bytes, expendable, killed_reason, return_freed_memory


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.mark.parametrize(("proc", "files", "expected"), [
    ("0::/kubepods/pod1\n", {"kubepods/pod1/memory.max": "2147483648\n"}, 2 << 30),  # v2, own cgroup
    ("0::/kubepods/pod1\n", {"kubepods/pod1/memory.max": "max\n"}, None),  # v2, no limit
    ("0::/\n", {"memory.max": "1073741824\n"}, 1 << 30),  # v2 inside a container's namespace
    ("5:memory:/docker/abc\n3:cpu:/docker/abc\n", {"memory/docker/abc/memory.limit_in_bytes": "2147483648\n"},
     2 << 30),  # v1
    ("5:memory:/\n", {"memory/memory.limit_in_bytes": "9223372036854771712\n"}, None),  # v1, "no limit"
    ("5:cpu,memory:/x\n", {"memory/memory.limit_in_bytes": "536870912\n"}, 512 << 20),  # v1, the mount's root
    ("", {}, None),  # no cgroup filesystem at all
])
def test_the_container_limit_is_read_from_cgroup_v1_and_v2(tmp_path, proc, files, expected):
    root = tmp_path / "cgroup"
    for name, text in files.items():
        write(root / name, text)
    write(tmp_path / "proc-cgroup", proc)
    assert container_limit_bytes(root, tmp_path / "proc-cgroup") == expected


def test_an_expendable_child_runs_niced_and_is_the_out_of_memory_killers_first_pick():
    code = "import os; print(os.nice(0), open('/proc/self/oom_score_adj').read().strip())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, preexec_fn=expendable,
                         check=True).stdout.split()
    assert out == ["19", "1000"]


def test_only_a_kill_is_explained_as_memory(monkeypatch):
    from ibedl.core import memory_limit

    monkeypatch.setattr(memory_limit, "container_limit_bytes", lambda: None)
    assert killed_reason("SIGSEGV", "build it") == ""
    assert killed_reason("SIGKILL", "build it").startswith(" (probably out of memory: the machine ran out of memory;"
                                                           " build it ahead of serving")


def test_under_a_replicas_limit_the_killer_takes_the_expendable_child_not_its_bigger_parent():
    """A parent holding 160 MiB starts an expendable child that grows to 160 MiB inside a 256 MiB cgroup: the kernel
    kills the child (oom_score_adj 1000) although the parent is as big, and the parent carries on."""
    from benchmarks.memory_cgroup import MemoryCgroup

    try:
        group = MemoryCgroup(256 * 2**20)
    except OSError as e:
        pytest.skip(f"no writable memory cgroup here: {e}")
    hog = "x = bytearray(b'1') * (160 * 2**20); import time; time.sleep(60)"
    parent = ("import subprocess, sys\n"
              "from ibedl.core.memory_limit import expendable\n"
              "held = bytearray(b'1') * (160 * 2**20)\n"
              f"done = subprocess.run([sys.executable, '-c', {hog!r}], preexec_fn=expendable, timeout=120)\n"
              "print(done.returncode, len(held))\n")
    try:
        out = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, timeout=180,
                             preexec_fn=group.preexec)
        stats = group.stats()
    finally:
        group.remove()
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["-9", str(160 * 2**20)]  # the child was killed; the parent kept its memory
    assert stats["oom_kills"] >= 1 and stats["limit_mib"] == 256


def test_freed_cuda_blocks_go_back_to_the_driver_only_where_cuda_is_in_use(monkeypatch):
    import torch

    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    return_freed_memory()
    assert emptied == []  # a CPU process never touches CUDA
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    return_freed_memory()
    assert emptied == [True]


def test_the_cuda_cache_is_emptied_only_under_its_lock(monkeypatch):
    """A CUDA graph's capture holds memory_limit.CUDA_CACHE (ibedl.core.backends.cuda_graphs): emptying the cache
    takes it too, so never during a capture."""
    import torch

    from ibedl.core import memory_limit

    events = []

    class Recording:
        def __enter__(self):
            events.append("acquire")

        def __exit__(self, *exc):
            events.append("release")

    monkeypatch.setattr(memory_limit, "CUDA_CACHE", Recording())
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("empty"))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    return_freed_memory()
    assert events == ["acquire", "empty", "release"]



@pytest.mark.parametrize("frozen_by", [None, "ibedl", "caller"])
def test_collect_garbage_frees_cycles_it_froze_and_leaves_a_callers_freeze_alone(unfrozen, frozen_by):
    """A dropped model is reachable only through its own cycles. Once the service froze its heap
    (collect_garbage(freeze=True)), gc.collect leaves such a cycle where it is; collect_garbage frees it and freezes
    the survivors again. A heap the caller froze itself is not touched."""
    import gc
    import weakref

    from ibedl.core.memory_limit import collect_garbage
    from tests.conftest import Cycle, generations_hold

    dropped, kept = Cycle(), Cycle()
    ref = weakref.ref(dropped)
    if frozen_by == "ibedl":
        collect_garbage(freeze=True)
    elif frozen_by == "caller":
        gc.freeze()
    frozen = gc.get_freeze_count()
    del dropped
    gc.collect()
    assert (ref() is None) == (frozen_by is None)  # a frozen cycle outlives gc.collect
    collect_garbage()
    assert (ref() is None) == (frozen_by != "caller")
    assert generations_hold(kept) == (frozen_by is None)  # what was frozen stays frozen
    if frozen_by == "caller":
        # neither unfrozen (0) nor grown; it may shrink a little: a frozen object another thread of the test process
        # lets go of is freed by its reference count (seen under xdist: 18 of 877,112)
        assert 0 < gc.get_freeze_count() <= frozen
