"""Actor, critic and reference on one FSDP2-sharded tiny Llama (gloo, CPU).

One rank runs in-process (the in-process group is torn down after the module); the two-rank
check spawns two worker processes and compares their value loss and gradients with one rank's.
"""

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.testing import assert_close

from miles.trainer import distributed
from miles.trainer.critic import (ACTOR, CRITIC, add_critic, apply_fsdp_with_head,
                                  disabled_adapters, reference_logits, use_adapter, values)
from miles.trainer.model import LoraSettings, load_policy, trainable_names

LORA = LoraSettings(r=4, alpha=8)
VOCAB = 78  # the tiny character tokenizer
TWO_RANK_TIMEOUT_S = 240  # generous: the 2 CPU cores may be shared with other jobs


@pytest.fixture(scope="module", autouse=True)
def process_group():
    yield
    distributed.destroy()


def build(model_dir):
    """Policy + critic + value head, sharded; gradients summed over ranks as the Learner does."""
    distributed.init_distributed()
    torch.manual_seed(0)  # same LoRA and value-head init on every rank
    model, _ = load_policy(model_dir, lora=LORA)
    add_critic(model, LORA)
    apply_fsdp_with_head(model)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model.train()


def batch(rows=slice(None)) -> dict[str, torch.Tensor]:
    """Four right-padded rows of random tokens (lengths 8, 6, 5, 3), and value targets."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(4, VOCAB, (4, 8), generator=generator)  # [B, L]
    mask = (torch.arange(8) < torch.tensor([[8], [6], [5], [3]])).long()  # [B, L]
    returns = torch.randn(4, 8, generator=generator)  # [B, L]
    full = {"input_ids": ids * mask, "attention_mask": mask,
            "position_ids": torch.arange(8).expand(4, 8), "returns": returns}
    return {key: value[rows] for key, value in full.items()}


def inputs(b: dict) -> dict:
    return {k: b[k] for k in ("input_ids", "attention_mask", "position_ids")}


def actor_loss(model, b: dict) -> torch.Tensor:
    """Mean negative logprob of the next tokens (a stand-in for the policy loss)."""
    logits = model(**inputs(b), use_cache=False).logits[:, :-1]  # [B, L-1, V]
    logp = logits.log_softmax(-1).gather(-1, b["input_ids"][:, 1:, None]).squeeze(-1)
    mask = b["attention_mask"][:, 1:].float()  # [B, L-1]
    return -(logp * mask).sum() / mask.sum()


def value_loss(model, b: dict, normaliser: float) -> torch.Tensor:
    """Squared error of the values against `returns`, summed over tokens / `normaliser`."""
    v = values(model, **inputs(b))  # [B, L]
    return ((v - b["returns"]).pow(2) * b["attention_mask"]).sum() / normaliser


def full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def grads(model) -> dict[str, torch.Tensor]:
    """Full gradients of the parameters that have one (a collective under FSDP2)."""
    return {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}


def params(model) -> dict[str, torch.Tensor]:
    return {n: full(p) for n, p in model.named_parameters()}


def is_actor(name: str) -> bool:
    return "lora_" in name and f".{ACTOR}." in name


def is_critic(name: str) -> bool:
    return ("lora_" in name and f".{CRITIC}." in name) or name.startswith("value_head.")


def nonzero(tensors: dict[str, torch.Tensor], pick) -> set[str]:
    return {n for n, t in tensors.items() if pick(n) and torch.count_nonzero(t)}


def test_each_loss_reaches_only_its_own_adapter(model_dir):
    model = build(model_dir)
    trainable = trainable_names(model)
    assert any(map(is_actor, trainable)) and any(map(is_critic, trainable))
    assert all(is_actor(n) or is_critic(n) for n in trainable)

    actor_loss(model, batch()).backward()
    actor_grads = grads(model)
    assert set(actor_grads) and all(map(is_actor, actor_grads)), sorted(actor_grads)
    assert nonzero(actor_grads, lambda n: "lora_B" in n)  # B starts at 0: its grad is the signal
    model.zero_grad(set_to_none=True)

    value_loss(model, batch(), normaliser=22.0).backward()
    critic_grads = grads(model)
    assert set(critic_grads) and all(map(is_critic, critic_grads)), sorted(critic_grads)
    assert {"value_head.weight", "value_head.bias"} <= nonzero(critic_grads, is_critic)
    assert nonzero(critic_grads, lambda n: "lora_B" in n)
    assert model.active_adapter == ACTOR  # values() put the actor back
    assert trainable_names(model) == trainable  # no switch froze or thawed anything


def test_switching_keeps_every_adapter_trainable(model_dir):
    model = build(model_dir)
    trainable = trainable_names(model)
    with use_adapter(model, CRITIC):
        assert model.active_adapter == CRITIC
        assert trainable_names(model) == trainable
    with disabled_adapters(model):
        assert trainable_names(model) == trainable
    assert trainable_names(model) == trainable
    assert model.active_adapter == ACTOR


def test_reference_is_the_base_model_after_the_actor_trained(model_dir):
    from transformers import AutoModelForCausalLM

    model = build(model_dir)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2,
                                  weight_decay=0.0)
    actor_loss(model, batch()).backward()
    optimizer.step()
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = base(**inputs(batch()), use_cache=False).logits  # [B, L, V]
        actor = model(**inputs(batch()), use_cache=False).logits
    assert (actor - expected).abs().max() > 1e-3  # control: the actor did move away
    assert_close(reference_logits(model, **inputs(batch())), expected, atol=1e-5, rtol=0)
    with torch.no_grad():  # and the actor is back after the reference forward
        assert_close(model(**inputs(batch()), use_cache=False).logits, actor, atol=0, rtol=0)


def test_one_adamw_steps_both_adapters_and_the_value_head(model_dir):
    model = build(model_dir)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3,
                                  weight_decay=0.0)
    before = params(model)
    actor_loss(model, batch()).backward()
    value_loss(model, batch(), normaliser=22.0).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    after = params(model)
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert all(is_actor(n) or is_critic(n) for n in changed), sorted(changed)
    assert any(is_actor(n) and "lora_B" in n for n in changed)
    assert any(is_critic(n) and "lora_B" in n for n in changed)
    assert {"value_head.weight", "value_head.bias"} <= changed
    # a second step: the values moved towards the returns
    first = value_loss(model, batch(), normaliser=22.0)
    for _ in range(3):
        value_loss(model, batch(), normaliser=22.0).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert value_loss(model, batch(), normaliser=22.0).item() < first.item()


def value_step(model_dir) -> dict:
    """Value loss and full critic gradients of one backward over this rank's rows
    (`rank::world_size`), normalised by the token count of all rows. A collective."""
    model = build(model_dir)
    rank, world = distributed.rank(), distributed.world_size()
    tokens = float(batch()["attention_mask"].sum())
    loss = value_loss(model, batch(slice(rank, None, world)), normaliser=tokens)
    loss.backward()
    total = distributed.all_reduce_sum(loss.detach().reshape(1).clone())
    return {"loss": float(total[0]), "grads": grads(model)}


def two_rank_worker(rank: int, port: int, model_dir, out_path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    result = value_step(model_dir)
    if rank == 0:
        torch.save(result, out_path)
    distributed.barrier()
    distributed.destroy()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(TWO_RANK_TIMEOUT_S + 60)
def test_two_ranks_match_one_rank(model_dir, tmp_path):
    one = value_step(model_dir)
    out_path = tmp_path / "two.pt"
    mp.spawn(two_rank_worker, args=(free_port(), model_dir, out_path), nprocs=2)  # raises
    two = torch.load(out_path)
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-6)
    assert one["grads"].keys() == two["grads"].keys()
    assert {"value_head.weight", "value_head.bias"} <= set(one["grads"])
    for name, grad in one["grads"].items():
        assert_close(two["grads"][name], grad, atol=1e-5, rtol=0, msg=name)
    assert nonzero(one["grads"], lambda n: "lora_B" in n)  # the comparison is not of zeros
