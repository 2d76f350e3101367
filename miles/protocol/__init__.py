"""The wire: record types, the versioned msgpack codec, size limits and topic names.

No torch and no Kafka client here: anything that reads or writes records (producers, trainer,
recorder, tests, other tools) depends on this package alone. See docs/wire-format.md.
"""

from miles.protocol.codec import decode, encode, signed_message
from miles.protocol.limits import (FLOAT_DTYPE, MAX_DEAD_LETTER_PAYLOAD_BYTES, MAX_MAP_ENTRIES,
                                   MAX_POLICY_VERSION, MAX_SAMPLES_PER_GROUP,
                                   MAX_TOKENS_PER_SEQUENCE, MAX_VOCAB_SIZE, SCHEMA_VERSION,
                                   TOKEN_DTYPE)
from miles.protocol.records import (ALL_TARGETS, COMMANDS, FINISH_REASONS, RECORD_TYPES,
                                    WEIGHT_FORMATS, Command, DeadLetter, Heartbeat, PromptTask,
                                    Sample, TrajectoryGroup, WeightVersion, WireRecord)
from miles.protocol.topics import MAX_RECORD_BYTES

__all__ = [
    "ALL_TARGETS", "COMMANDS", "FINISH_REASONS", "FLOAT_DTYPE", "MAX_DEAD_LETTER_PAYLOAD_BYTES",
    "MAX_MAP_ENTRIES", "MAX_POLICY_VERSION", "MAX_RECORD_BYTES", "MAX_SAMPLES_PER_GROUP",
    "MAX_TOKENS_PER_SEQUENCE", "MAX_VOCAB_SIZE", "RECORD_TYPES", "SCHEMA_VERSION", "TOKEN_DTYPE",
    "WEIGHT_FORMATS", "Command", "DeadLetter", "Heartbeat", "PromptTask", "Sample",
    "TrajectoryGroup", "WeightVersion", "WireRecord", "decode", "encode", "signed_message",
]
