"""The one exception hierarchy of Miles.

Third-party exceptions (aiokafka, msgpack, torch, ...) are wrapped at the module boundary that
imports them, so callers only ever catch `MilesError` subclasses.
"""


class MilesError(Exception):
    """Base class of every error Miles raises on purpose."""


class ConfigError(MilesError):
    """A configuration value is missing, of the wrong type or out of range."""


class StoppedError(MilesError):
    """Work given up part-way because a stop was asked for (a signal), nothing of it kept."""


class CodecError(MilesError):
    """A wire record could not be encoded or decoded; names the field and the reason."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class BusError(MilesError):
    """A message-bus operation failed (broker unreachable, topic error, closed client, ...)."""


class RecordTooLargeError(BusError):
    """A record is larger than the bus accepts; raised before anything is sent."""


class AuthenticationError(BusError):
    """The cluster refused this client's identity: a wrong password or user, a SASL mechanism
    it does not offer, or a TLS handshake that failed (an unknown CA, a wrong host name).
    Retrying with the same settings cannot help."""


class AuthorizationError(BusError):
    """The cluster knows this client but an ACL denies the operation (a topic, a consumer
    group or the cluster); retrying cannot help until an admin grants it."""


class BrokerError(MilesError):
    """The local Kafka broker could not be assembled, started, stopped or reached."""


class WeightsError(MilesError):
    """A weight version could not be written, fetched, verified or applied."""


class MissingWeightsError(WeightsError):
    """An announced version's file is not (yet) in the weight store; it may appear later."""


class EngineError(MilesError):
    """A rollout engine could not be built, could not generate, or rejected a weight load."""


class EngineUnavailableError(EngineError):
    """The engine could not be reached (a server down or restarting, no answer in time): the
    same call may succeed later, so what it carried (a weight version) is kept and retried."""


class EngineRejectedError(EngineError):
    """The engine refused a request for what it asked (a prompt and budget longer than the
    engine's context, a value the engine does not accept): the same request fails again, so the
    caller fails what made it (an episode), never retries the batch for it."""


class CheckpointError(MilesError):
    """A trainer checkpoint is incomplete, damaged or cannot be loaded or published."""


class StepError(MilesError):
    """A train step failed on its data (a non-finite loss or gradient norm, or an error raised
    while processing the batch); the learner's weights and optimizer state are as before it."""


class FencedError(MilesError):
    """A newer trainer generation took over this run's output folder; this trainer must stop
    without writing anything more."""


class CommitFailedError(BusError):
    """A commit was refused because the consumer group's membership changed (a rebalance moved
    the partitions, or this member was dropped from the group); the records are re-delivered
    to whichever member now owns them."""


class EnvError(MilesError):
    """An environment broke its contract (a malformed Step, a step before reset or after the
    episode ended) or could not be loaded; the producer fails that episode, not the run."""


class EpisodeError(MilesError):
    """One episode cannot go on: its environment raised or timed out, or its context cannot be
    extended token-in, token-out (a chat template that rewrites earlier turns). `kind` names
    the cause (`env_error`, `env_timeout`, `template`, `bad_task`); the producer records and
    counts the episode as failed and never trains on it, the batch goes on."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class ToolError(MilesError):
    """A tool could not do what the model asked; raised by a tool, its message becomes the
    `error: ...` result the model sees (no traceback), counted as a tool error."""
