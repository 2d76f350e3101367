"""The trainer: FSDP2-sharded policy (LoRA via peft by default), micro-batching, the train step,
checkpointable state, adapter export.

Modules: `distributed` (process group + collectives), `model` (load, shard, export),
`batching` (groups -> micro-batches), `learner` (optimizer and train step). Nothing here touches
the bus or asyncio: the trainer daemon wires a `Learner` to the trajectory topic.
"""
