"""A host-memory copy of what an optimizer step changes: the trainable parameters and the
optimizer's state. The learner takes one before a step of several mini-batches, so a step whose
later mini-batch fails (after an earlier one already stepped) is undone, not left half applied.

Simplifications:
- Only this rank's shards (the local tensors of DTensors) are copied: restoring is local, no
  collective, and every rank restores the same step.
- Copies go to host memory (the device keeps its room for the step); for LoRA they are small,
  under full fine-tuning about three times the rank's share of the trained weights.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class Snapshot:
    """`params` and their state in `optimizer`, as of construction; `restore()` puts them back."""

    def __init__(self, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer):
        self.params = params
        self.optimizer = optimizer
        with torch.no_grad():
            self.values = [_local(p).detach().to("cpu", copy=True) for p in params]
            self.states = [{k: _local(v).detach().to("cpu", copy=True)
                            if isinstance(v, torch.Tensor) else v
                            for k, v in optimizer.state[p].items()}
                           if p in optimizer.state else None for p in params]

    @torch.no_grad()
    def restore(self) -> None:
        for param, value, saved in zip(self.params, self.values, self.states):
            _local(param).copy_(value)
            if saved is None:
                self.optimizer.state.pop(param, None)
                continue
            state = self.optimizer.state[param]
            for key, item in saved.items():
                if isinstance(item, torch.Tensor) and isinstance(state.get(key), torch.Tensor):
                    _local(state[key]).copy_(item)
                else:
                    state[key] = item
