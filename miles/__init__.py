"""Miles: asynchronous RL post-training of LLMs over a durable experience log (Kafka)."""

__version__ = "0.1.0"
