"""learner.precision "auto": bf16 on CUDA, and on a CPU where bf16 is both faster and close enough.

On CPUs bf16 pays only with bf16 dot-product instructions; without them torch emulates it and a
step gets slower. The check that decides (`cpu_bf16_verdict`, once per process):
1. the CPU advertises bf16 dot products (x86 `avx512_bf16` or `amx_bf16`, Arm `bf16`);
2. a matmul of a transformer MLP's shape ([rows, h] x [h, 4h], h = `CHECK_HIDDEN`) is timed in
   fp32 and in bf16 (best of `CHECK_REPEATS`, torch's threads): bf16 must be at least
   `MIN_SPEEDUP` faster;
3. the bf16 product is within `MAX_REL_ERROR` of the fp32 one (relative Frobenius error; a
   kernel that accumulates in bf16 over h = 1024 terms fails it).
Measured on the demo's CPU (docs/benchmarks.md, "Miles against TRL"): the demo's train step is
1.7x faster in bf16, and the held-out curve is the same.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CPU_BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}  # /proc/cpuinfo flags (x86) / features (Arm)
CHECK_HIDDEN = 256
CHECK_ROWS = 1024
CHECK_REPEATS = 5
MIN_SPEEDUP = 1.2
MAX_REL_ERROR = 1e-2


@dataclass(frozen=True)
class Verdict:
    bf16: bool  # compute in bf16
    why: str  # the numbers behind it, for the log


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The CPU's feature flags (empty where /proc/cpuinfo is unreadable, e.g. macOS)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def _best_seconds(a: torch.Tensor, b: torch.Tensor) -> float:
    torch.matmul(a, b)  # warm-up: kernel selection, allocation
    best = float("inf")
    for _ in range(CHECK_REPEATS):
        began = time.perf_counter()
        torch.matmul(a, b)
        best = min(best, time.perf_counter() - began)
    return best


def matmul_check(hidden: int = CHECK_HIDDEN, rows: int = CHECK_ROWS) -> tuple[float, float]:
    """(bf16 speed-up over fp32, bf16's relative error) of one MLP-shaped CPU matmul."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(rows, hidden, generator=generator)
    b = torch.randn(hidden, 4 * hidden, generator=generator)
    fp32 = _best_seconds(a, b)
    a16, b16 = a.bfloat16(), b.bfloat16()
    bf16 = _best_seconds(a16, b16)
    exact = a16.float() @ b16.float()  # the same rounded inputs: only the kernel's error left
    error = float((torch.matmul(a16, b16).float() - exact).norm() / exact.norm())
    return fp32 / bf16, error


def decide(flags: set[str], speedup: float | None, error: float | None) -> Verdict:
    """The verdict from the CPU's flags and (when it has bf16 instructions) the matmul check."""
    if not flags & CPU_BF16_FLAGS:
        return Verdict(False, "fp32: the CPU has no bf16 dot-product instructions")
    numbers = f"bf16 matmul {speedup:.2f}x fp32's speed, relative error {error:.1e}"
    if speedup < MIN_SPEEDUP:
        return Verdict(False, f"fp32: {numbers} (needs >= {MIN_SPEEDUP}x)")
    if not error <= MAX_REL_ERROR:
        return Verdict(False, f"fp32: {numbers} (needs <= {MAX_REL_ERROR:.0e})")
    return Verdict(True, f"bf16: {numbers}")


@functools.cache
def cpu_bf16_verdict() -> Verdict:
    """Whether "auto" computes in bf16 on this CPU (checked once per process)."""
    flags = cpu_flags()
    checked = matmul_check() if flags & CPU_BF16_FLAGS else (None, None)
    verdict = decide(flags, *checked)
    log.info("learner.precision auto on this CPU: %s", verdict.why)
    return verdict


def compute_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The dtype forward and backward run in under `precision` ("auto", "fp32" or "bf16",
    checked by `LearnerConfig`) on `device`."""
    if precision == "auto":
        bf16 = device.type == "cuda" or (device.type == "cpu" and cpu_bf16_verdict().bf16)
    else:
        bf16 = precision == "bf16"
    return torch.bfloat16 if bf16 else torch.float32
