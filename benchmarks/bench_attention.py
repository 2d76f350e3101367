"""torch's fused CPU attention kernel against its math kernel and the learner's short-line
attention, forward + backward, by line width.

Run by hand (not a test), from the repository root:

    python benchmarks/bench_attention.py [--threads 1]

Each shape is a micro-batch of lines (R lines x T tokens, causal boolean mask [R, 1, T, T], as the
learner's packed and shared-prompt lines), H heads of d; `scaled_dot_product_attention` forward
and backward under `sdpa_kernel` pinned to one kernel, median of 5 after 2 warm-ups, in bf16 and
fp32; in bf16 also `miles.trainer.attention.short_line_attention` (fp32 scores over the
key/value heads, the mask as an additive bias), with as many key/value heads as query heads.
It decides `miles.trainer.attention.SHORT_LINE_WIDTH`; results in docs/benchmarks.md
("Attention kernels").
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from miles.trainer.attention import additive_bias, short_line_attention

SHAPES = [  # (T, R, H, d): the demo's lines (4 heads of 32) and a wider model's
    (32, 40, 4, 32), (64, 20, 4, 32), (128, 10, 4, 32), (256, 5, 4, 32), (512, 4, 4, 32),
    (2048, 1, 4, 32), (128, 8, 16, 64), (256, 4, 16, 64), (2048, 1, 16, 64)]
KERNELS = {"fused": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}


def median_ms(step) -> float:
    """Median of 5 timed calls of `step` after 2 warm-ups, in ms."""
    times = []
    for i in range(7):
        start = time.perf_counter()
        step()
        if i >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def inputs(dtype: torch.dtype, T: int, R: int, H: int, d: int) -> tuple:
    """(q, k, v, causal boolean mask [R, 1, T, T]) of one micro-batch of lines."""
    q, k, v = (torch.randn(R, H, T, d, dtype=dtype, requires_grad=True) for _ in range(3))
    return q, k, v, torch.ones(T, T, dtype=torch.bool).tril().expand(R, 1, T, T)


def timed_ms(kernel: SDPBackend, dtype: torch.dtype, T: int, R: int, H: int, d: int) -> float:
    q, k, v, mask = inputs(dtype, T, R, H, d)
    with sdpa_kernel([kernel]):
        return median_ms(lambda: F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask).sum().backward())


def short_line_ms(dtype: torch.dtype, T: int, R: int, H: int, d: int) -> float:
    q, k, v, mask = inputs(dtype, T, R, H, d)
    return median_ms(lambda: short_line_attention(
        q, k, v, additive_bias(mask, T, causal=True), d ** -0.5).sum().backward())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print("| dtype | T | lines | heads x dim | fused ms | math ms | fused / math | short-line ms |")
    print("|---|---:|---:|---|---:|---:|---:|---:|")
    for dtype in (torch.bfloat16, torch.float32):
        for T, R, H, d in SHAPES:
            ms = {name: timed_ms(kernel, dtype, T, R, H, d) for name, kernel in KERNELS.items()}
            short = f"{short_line_ms(dtype, T, R, H, d):.1f}" if dtype == torch.bfloat16 else "-"
            print(f"| {str(dtype).split('.')[1]} | {T} | {R} | {H} x {d} | {ms['fused']:.1f} | "
                  f"{ms['math']:.1f} | {ms['fused'] / ms['math']:.2f} | {short} |")


if __name__ == "__main__":
    main()
