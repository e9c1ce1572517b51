"""The CPU every speed figure records: its model and instruction sets from cpuinfo, the cores this process may use."""

import os
import platform

from benchmarks.common import cpu_features


def test_model_and_flags_come_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Example CPU 9000\nflags\t\t: fpu sse avx2 avx512f avx512_vnni\n\n"
                    "processor\t: 1\nmodel name\t: Example CPU 9000\nflags\t\t: fpu sse avx2 avx512f avx512_vnni\n")
    cpu = cpu_features(info)
    assert cpu["model"] == "Example CPU 9000"
    assert (cpu["avx2"], cpu["avx512f"], cpu["avx512_vnni"]) == (True, True, True)
    assert (cpu["avx512_bf16"], cpu["amx_bf16"], cpu["amx_int8"]) == (False, False, False)
    assert cpu["cores"] == len(os.sched_getaffinity(0))


def test_without_cpuinfo_the_platform_names_the_machine(tmp_path):
    cpu = cpu_features(tmp_path / "absent")
    assert cpu["model"] == (platform.processor() or platform.machine()) and cpu["model"]
    assert not any(cpu[f] for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8"))
