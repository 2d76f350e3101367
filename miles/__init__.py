"""Miles: asynchronous RL post-training of LLMs over a durable experience log (Kafka)."""

__version__ = "0.1.0"


def train(*args, **kwargs):
    """A whole run from Python: `miles.api.train` (imported on first use, so `import miles`
    stays light)."""
    from miles.api import train as run_training

    return run_training(*args, **kwargs)
