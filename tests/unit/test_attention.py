"""The learner's short-line attention against torch's `scaled_dot_product_attention` in fp32."""

import pytest
import torch
import torch.nn.functional as F

from miles.trainer import attention as attn

LINES, HEADS, KV_HEADS, T, D = 3, 4, 2, 9, 8


def qkv(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(LINES, h, T, D, generator=g, dtype=torch.float32).to(dtype)
                 .requires_grad_() for h in (HEADS, KV_HEADS, KV_HEADS))


def reference(q, k, v, mask=None, causal=False):
    """torch's sdpa in fp32 on repeated key/value heads, [B, T, H, D]."""
    k, v = (x.float().repeat_interleave(HEADS // KV_HEADS, dim=1) for x in (k, v))
    return F.scaled_dot_product_attention(q.float(), k, v, attn_mask=mask,
                                          is_causal=causal).transpose(1, 2)


def shared_prompt_mask():
    """A line of two groups: a prompt of 3 and two samples each, every sample seeing its
    prompt and itself, [LINES, 1, T, T] boolean."""
    segments = [(0, 3, [(3, 5), (5, 6)]), (6, 8, [(8, 9)])]
    mask = torch.zeros(T, T, dtype=torch.bool)
    for start, end, samples in segments:
        mask[start:end, start:end] = torch.ones(end - start, end - start).tril().bool()
        for a, b in samples:
            mask[a:b, start:end] = True
            mask[a:b, a:b] = torch.ones(b - a, b - a).tril().bool()
    return mask.expand(LINES, 1, T, T)


class Module(torch.nn.Module):
    num_key_value_groups = HEADS // KV_HEADS
    is_causal = True


@pytest.mark.parametrize("kind", ["boolean", "additive", "causal"])
def test_short_line_attention_is_sdpa_in_fp32(kind):
    q, k, v = qkv()
    mask = shared_prompt_mask()
    given = {"boolean": mask, "causal": None,
             "additive": torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))}[kind]
    out, _ = attn.attention(Module(), q.bfloat16(), k.bfloat16(), v.bfloat16(), given)
    out.float().square().sum().backward()
    grads = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    want = reference(q.bfloat16(), k.bfloat16(), v.bfloat16(),
                     mask=None if kind == "causal" else mask, causal=kind == "causal")
    want.bfloat16().float().square().sum().backward()
    assert out.dtype == torch.bfloat16 and out.shape == (LINES, T, HEADS, D)
    torch.testing.assert_close(out.float(), want.bfloat16().float(), rtol=1e-2, atol=1e-2)
    for got, exact in zip(grads, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(got, exact, rtol=2e-2, atol=2e-2)


def test_a_fully_masked_row_stays_finite_and_leaves_the_others_alone():
    q, k, v = qkv(torch.bfloat16)
    mask = shared_prompt_mask().clone()
    mask[:, :, 4] = False  # a padding position: it attends to nothing
    out, _ = attn.attention(Module(), q, k, v, mask)
    out.float().sum().backward()
    assert all(torch.isfinite(x).all() for x in (out, q.grad, k.grad, v.grad))
    want = reference(q, k, v, mask=shared_prompt_mask())
    kept = [t for t in range(T) if t != 4]
    torch.testing.assert_close(out.float()[:, kept], want[:, kept], rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype, length, dropout, extra, short", [
    (torch.bfloat16, T, 0.0, {}, True),
    (torch.float32, T, 0.0, {}, False),  # fp32: torch's fused kernel is the faster one
    (torch.bfloat16, attn.SHORT_LINE_WIDTH + 1, 0.0, {}, False),  # long lines: fused
    (torch.bfloat16, T, 0.1, {}, False),  # dropout: sdpa's
    (torch.bfloat16, T, 0.0, {"softcap": 30.0}, False),  # not applied here: sdpa's (refuses)
    (torch.bfloat16, T, 0.0, {"softcap": None}, True),  # given as None: nothing to apply
])
def test_the_short_path_is_taken_only_for_short_bf16_lines(monkeypatch, dtype, length, dropout,
                                                           extra, short):
    taken = []
    monkeypatch.setattr(attn, "short_line_attention",
                        lambda *a: taken.append(True) or torch.zeros(1))
    monkeypatch.setattr(attn, "sdpa_attention_forward", lambda *a, **kw: (torch.zeros(1), None))
    q = torch.zeros(1, HEADS, length, D, dtype=dtype)
    k = torch.zeros(1, KV_HEADS, length, D, dtype=dtype)
    attn.attention(Module(), q, k, k, None, dropout=dropout, **extra)
    assert bool(taken) == short
