"""learner.precision "auto": the check that picks bf16 on a CPU, and what it decides."""

from __future__ import annotations

import pytest
import torch

from miles.trainer import precision
from miles.trainer.precision import Verdict, compute_dtype, cpu_flags, decide, matmul_check


def test_flags_are_read_from_cpuinfo(tmp_path):
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx512f avx512_bf16\n\n"
                   "processor\t: 1\nflags\t\t: fpu sse2 avx512f avx512_bf16\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n")
    assert {"avx512_bf16", "avx512f"} <= cpu_flags(x86)
    assert "bf16" in cpu_flags(arm)
    assert cpu_flags(tmp_path / "missing") == set()


def test_the_verdict_needs_instructions_speed_and_closeness():
    assert not decide({"sse2", "avx2"}, None, None).bf16  # no bf16 instructions: not even timed
    assert decide({"avx512_bf16"}, 1.8, 3e-3).bf16
    assert decide({"amx_bf16"}, 1.8, 3e-3).bf16
    assert decide({"bf16"}, 1.8, 3e-3).bf16  # Arm
    slow = decide({"avx512_bf16"}, 1.1, 3e-3)  # instructions, but not faster enough
    assert not slow.bf16 and "1.10x" in slow.why
    loose = decide({"avx512_bf16"}, 2.0, 0.05)  # faster, but a kernel that loses precision
    assert not loose.bf16 and "5.0e-02" in loose.why
    assert not decide({"avx512_bf16"}, 2.0, float("nan")).bf16


def test_the_matmul_check_measures_this_cpu():
    speedup, error = matmul_check(hidden=64, rows=128)
    assert speedup > 0
    assert 0 <= error < 1e-2  # bf16 kernels accumulate in fp32: only rounding of the output


@pytest.mark.parametrize("bf16", [True, False])
def test_auto_follows_the_verdict_on_a_cpu(monkeypatch, bf16):
    monkeypatch.setattr(precision, "cpu_bf16_verdict", lambda: Verdict(bf16, "test"))
    cpu = torch.device("cpu")
    assert compute_dtype("auto", cpu) == (torch.bfloat16 if bf16 else torch.float32)
    assert compute_dtype("fp32", cpu) == torch.float32  # explicit settings are not checked
    assert compute_dtype("bf16", cpu) == torch.bfloat16


def test_auto_is_bf16_on_cuda_without_the_cpu_check(monkeypatch):
    monkeypatch.setattr(precision, "cpu_bf16_verdict", lambda: pytest.fail("checked"))
    assert compute_dtype("auto", torch.device("cuda")) == torch.bfloat16
