"""The learner's LoRA linears run `fused_lora_forward` (one addmm instead of peft's scale and
add at the output's width): the same outputs and gradients as peft's own forward, which still
runs whenever the plain case does not hold (adapters disabled, a LoRA bias)."""

from __future__ import annotations

import pytest
import torch

from miles.engines.base import LoraSettings
from miles.trainer.model import fuse_lora_forwards, load_policy


def lora_linears(model):
    from peft.tuners.lora.layer import Linear

    return [m for m in model.modules() if type(m) is Linear]


def peft_forward(model) -> None:
    for module in lora_linears(model):
        module.__dict__.pop("forward", None)


def step(model, ids: torch.Tensor, seed: int = 0) -> tuple[torch.Tensor, dict]:
    """Logits and the adapter's gradients of one forward and backward."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    logits = model(input_ids=ids).logits
    (logits.float().square().mean()).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                             if p.requires_grad}


def randomised(model):
    """lora_B starts at zero (the adapter adds nothing): give it values, so the test sees it."""
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    return model


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_the_fused_forward_matches_peft_in_outputs_and_gradients(model_dir, dtype, tol):
    model = randomised(load_policy(model_dir, lora=LoraSettings(r=4, alpha=8))[0]).to(dtype)
    linears = lora_linears(model)
    assert linears and all("forward" in m.__dict__ for m in linears)  # load_policy fused them
    ids = torch.randint(3, 30, (3, 9))
    fused_logits, fused_grads = step(model, ids)
    peft_forward(model)
    logits, grads = step(model, ids)
    torch.testing.assert_close(fused_logits, logits, rtol=tol, atol=tol)
    assert fused_grads.keys() == grads.keys() and grads
    for name in grads:
        torch.testing.assert_close(fused_grads[name], grads[name], rtol=tol, atol=tol,
                                   msg=lambda m, name=name: f"{name}: {m}")


def backward_ops(output: torch.Tensor) -> set[str]:
    seen, todo = set(), [output.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node.name() not in seen:
            seen.add(node.name())
            todo.extend(next_node for next_node, _ in node.next_functions)
    return seen


def test_the_fused_forward_is_the_one_that_runs(model_dir):
    model = randomised(load_policy(model_dir, lora=LoraSettings(r=4, alpha=8))[0])
    module = lora_linears(model)[0]
    x = torch.randn(2, 5, module.in_features, requires_grad=True)
    fused = backward_ops(module(x))  # the in-place addmm on a view records as CopySlices
    assert "torch::autograd::CopySlices" in fused and "AddBackward0" not in fused
    peft_forward(model)
    assert "AddBackward0" in backward_ops(module(x))  # peft's result + lora * scaling


def test_dropout_draws_the_same_masks(model_dir):
    model = randomised(load_policy(model_dir, lora=LoraSettings(r=4, alpha=8, dropout=0.3))[0])
    model.train()
    ids = torch.randint(3, 30, (2, 7))
    fused = step(model, ids, seed=5)
    peft_forward(model)
    reference = step(model, ids, seed=5)
    torch.testing.assert_close(fused[0], reference[0], rtol=1e-6, atol=1e-6)
    assert not torch.allclose(reference[0], step(model, ids, seed=6)[0])  # dropout is live


def test_disabled_adapters_run_the_base_model(model_dir):
    model = randomised(load_policy(model_dir, lora=LoraSettings(r=4, alpha=8))[0])
    base = load_policy(model_dir, lora=None)[0]
    ids = torch.randint(3, 30, (2, 7))
    with torch.no_grad(), model.disable_adapter():
        off = model(input_ids=ids).logits
    torch.testing.assert_close(off, base(input_ids=ids).logits)
    with torch.no_grad():
        assert not torch.allclose(model(input_ids=ids).logits, off)


def test_a_lora_bias_runs_peft_forward(model_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"],
                                      lora_bias=True))
    randomised(model)
    ids = torch.randint(3, 30, (2, 7))
    with torch.no_grad():
        reference = model(input_ids=ids).logits
        fuse_lora_forwards(model)
        torch.testing.assert_close(model(input_ids=ids).logits, reference)
