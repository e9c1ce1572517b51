"""The CPU's instruction-set classes that change OpenVINO's numbers: the int8 class of a CPU's flags, and oneDNN's
instruction cap (which the tests use to run this CPU as an AVX2-only one)."""

import pytest

from ibedl.core import cpu_isa


@pytest.mark.parametrize(("flags", "cap", "isa"), [
    ({"avx2", "avx512bw", "avx512_vnni", "amx_int8"}, "", "amx-int8"),
    ({"avx2", "avx512bw", "avx512_vnni"}, "", "avx512-vnni"),
    ({"avx2", "avx_vnni"}, "", "avx-vnni"),
    ({"avx2", "avx512bw"}, "", "avx512bw"),
    ({"avx2", "fma"}, "", "avx2"),
    ({"sse4_2"}, "", "other-"),
    # oneDNN's cap (ONEDNN_MAX_CPU_ISA) makes OpenVINO run an older CPU's kernels: the class follows it
    ({"avx2", "avx512bw", "avx512_vnni", "amx_int8"}, "AVX2", "avx2"),
    ({"avx2", "avx512bw", "avx512_vnni", "amx_int8"}, "AVX512_CORE", "avx512bw"),
    ({"avx2", "avx512bw", "avx512_vnni", "amx_int8"}, "AVX512_CORE_BF16", "avx512-vnni"),
    ({"avx2", "avx512bw", "avx512_vnni", "amx_int8"}, "AVX512_CORE_AMX", "amx-int8"),
    ({"avx2", "avx512bw"}, "AVX512_CORE_VNNI", "avx512bw"),  # a cap never adds instructions
    ({"avx2", "avx512bw"}, "DEFAULT", "avx512bw"),
])
def test_the_int8_instruction_set_class_of_a_cpu(flags, cap, isa):
    assert cpu_isa.int8_isa(flags, cap).startswith(isa)


def test_the_int8_class_and_bf16_follow_onednn_s_cap_from_the_environment(monkeypatch):
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert cpu_isa.int8_isa({"avx2", "avx512_vnni"}) == "avx2" and cpu_isa.capped_without_bf16()
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.setenv("DNNL_MAX_CPU_ISA", "avx512_core")
    assert cpu_isa.int8_isa({"avx2", "avx512bw", "avx512_vnni"}) == "avx512bw" and cpu_isa.capped_without_bf16()
    monkeypatch.setenv("DNNL_MAX_CPU_ISA", "AVX512_CORE_BF16")
    assert not cpu_isa.capped_without_bf16()
    monkeypatch.delenv("DNNL_MAX_CPU_ISA")
    assert cpu_isa.onednn_cap() == "" and not cpu_isa.capped_without_bf16()


def test_this_cpu_s_flags_are_read():
    flags = cpu_isa.cpu_flags()
    assert isinstance(flags, set) and all(isinstance(f, str) and " " not in f for f in flags)
    assert cpu_isa.int8_isa(flags, "") == cpu_isa.int8_isa(cap="")


def test_the_cpu_kind_is_described_in_one_line(monkeypatch):
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: {"avx2", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16"})
    monkeypatch.setattr(cpu_isa, "model_name", lambda: "AMD EPYC")
    monkeypatch.setattr(cpu_isa.os, "cpu_count", lambda: 2)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    assert cpu_isa.describe() == ("AMD EPYC, 2 cores: int8 class avx512-vnni, native bf16 yes, avx512f yes, "
                                  "oneDNN cap none")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # this CPU as an AVX2-only one
    assert cpu_isa.describe() == ("AMD EPYC, 2 cores: int8 class avx2, native bf16 no, avx512f yes, "
                                  "oneDNN cap avx2")


def test_a_run_s_machine_names_its_device_on_this_host_and_a_bad_device_is_refused(monkeypatch):
    import torch

    assert cpu_isa.describe_device("cpu") == cpu_isa.describe_device(torch.device("cpu")) == cpu_isa.describe()
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: f"NVIDIA H200 ({device})")
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    assert cpu_isa.describe_device(torch.device("cuda", 0)) == (
        f"NVIDIA H200 (cuda:0) (CUDA 12.4) on host {cpu_isa.describe()}")
    assert cpu_isa.describe_device("mps") == f"mps on host {cpu_isa.describe()}"
    for bad in ("", None, " cpu"):
        with pytest.raises(ValueError, match=f"got {bad!r}"):
            cpu_isa.describe_device(bad)
