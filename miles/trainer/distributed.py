"""The trainer's process group: start-up from torchrun's environment, and the few collectives
the trainer uses (sum/max all-reduce, byte broadcast, barrier).

Simplifications:
- One flat data-parallel group over all ranks (FSDP2 shards over it); no tensor/pipeline
  parallelism, so no multi-dimensional mesh yet.
- Backend by device: NCCL when CUDA is available, gloo otherwise (CPU tests and laptops).
- Not launched by torchrun (no RANK/WORLD_SIZE in the environment): a 1-rank group over an
  in-process `HashStore`, so FSDP2 is the same code path with one rank; nothing listens on a port.
- Records go between ranks as bytes (their wire encoding), never pickled: `broadcast_bytes`.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from miles.errors import MilesError

TIMEOUT = timedelta(minutes=30)
"""How long a collective may wait for the slowest rank before it fails."""


def init_distributed() -> torch.device:
    """Join (or create) the default process group; return this rank's compute device.

    Idempotent: a second call, or a caller that already initialised the group, reuses it.
    """
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        backend = "nccl" if use_cuda else "gloo"
        try:
            if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
                dist.init_process_group(backend, init_method="env://", timeout=TIMEOUT)
            else:
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                        timeout=TIMEOUT)
        except (RuntimeError, ValueError) as exc:
            raise MilesError(f"could not initialise the {backend} process group: {exc}") from exc
    return comm_device()


def comm_device() -> torch.device:
    """Device of this rank's tensors for collectives (NCCL needs CUDA tensors, gloo CPU ones)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main() -> bool:
    """True on rank 0 (and when no process group exists)."""
    return rank() == 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def destroy() -> None:
    """Tear the default process group down (no-op when there is none).

    On a clean exit call `barrier()` first: with gloo, a rank that tears down while a peer is
    still finishing its last collective can abort (`terminate called without an active
    exception`). After an error, skip the barrier (a crashed peer would hang it).
    """
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over ranks, in place; returns it."""
    return _all_reduce(tensor, dist.ReduceOp.SUM)


def all_reduce_max(tensor: torch.Tensor) -> torch.Tensor:
    """Element-wise max of `tensor` over ranks, in place; returns it."""
    return _all_reduce(tensor, dist.ReduceOp.MAX)


def any_rank(flag: bool) -> bool:
    """True on every rank when `flag` is true on any (a collective)."""
    return bool(all_reduce_max(torch.tensor([int(flag)], dtype=torch.int64)).item())


def _all_reduce(tensor: torch.Tensor, op: dist.ReduceOp) -> torch.Tensor:
    if world_size() == 1:
        return tensor
    on_device = tensor.to(comm_device())
    dist.all_reduce(on_device, op=op)
    if on_device is not tensor:
        tensor.copy_(on_device)
    return tensor


def broadcast_bytes(payload: bytes | None, src: int = 0) -> bytes:
    """`payload` of rank `src` on every rank (other ranks pass None): the length, then the bytes
    as a uint8 tensor. No pickling, so a record from the wire stays data."""
    if rank() == src and payload is None:
        raise MilesError(f"broadcast_bytes: rank {src} is the source and must pass bytes")
    if world_size() == 1:
        return bytes(payload)  # type: ignore[arg-type]
    device = comm_device()
    length = torch.tensor([len(payload) if rank() == src else 0], dtype=torch.int64,
                          device=device)
    dist.broadcast(length, src=src)
    if int(length.item()) == 0:
        return b""
    if rank() == src:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)  # [N]
    else:
        data = torch.empty(int(length.item()), dtype=torch.uint8, device=device)  # [N]
    dist.broadcast(data, src=src)
    return data.cpu().numpy().tobytes()
