"""The records that travel on a run's topics, as frozen keyword-only dataclasses.

prompts: `PromptTask`; trajectories: `TrajectoryGroup` (of `Sample`s); control: `WeightVersion`,
`Command`; status: `Heartbeat`; dlq: `DeadLetter`. A `Sample` is one response or, with a
`loss_mask` (1.4), one multi-turn episode: the policy's tokens and the environment's observation
tokens in order, only the former trained (`policy_mask`, `policy_versions`). The three records that move a follower's
state (`WeightVersion`, `Command`, a trainer's `Heartbeat`) carry an optional Ed25519
`signature` (1.3) over `miles.protocol.codec.signed_message`. The field names here are the wire names
(`docs/wire-format.md` lists them with their types and bounds).

Simplifications:
- Records hold data and a few derived values, nothing else. Their checks live in the codec
  (`miles.protocol.schema`), which runs the same reader on `encode` and on `decode`, so anything a
  producer can encode a consumer can decode. Constructing a record checks nothing.
- Arrays are 1-D numpy arrays. Decoded arrays are read-only views over the received bytes
  (zero-copy); call `.copy()` before writing into one. On encode any dtype of the same kind
  (e.g. int64 token ids, float64 logprobs) is accepted and cast to the wire dtype.
- A field with a default is optional on the wire (absent means the default); every other field
  is required. Timestamps (`created_at`, unix seconds) are always explicit.
- Records compare by value, arrays element-wise (numpy's `==` would be ambiguous); they are not
  hashable.
"""

from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import ClassVar, Literal, TypeVar

import numpy as np
import numpy.typing as npt

from miles.protocol.limits import (FLOAT_DTYPE, MASK_DTYPE, MAX_DEAD_LETTER_PAYLOAD_BYTES,
                                   TOKEN_DTYPE)

Scalar = str | int | float | bool
ScalarMap = dict[str, Scalar]
IntArray = npt.NDArray[np.int32]
FloatArray = npt.NDArray[np.float32]
MaskArray = npt.NDArray[np.uint8]

FINISH_REASONS = ("stop", "length", "abort")
WEIGHT_FORMATS = ("lora", "full")
COMMANDS = ("pause", "resume", "drain", "stop")
ALL_TARGETS = "*"


def array_field(dtype: np.dtype, **kwargs):
    """A dataclass field holding a 1-D array that travels with wire dtype `dtype`."""
    return field(metadata={"dtype": dtype}, **kwargs)


def _values_equal(a: object, b: object) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)
                and a.shape == b.shape and bool(np.array_equal(a, b)))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_values_equal(x, y) for x, y in zip(a, b))
    return a == b


class WireRecord:
    """Base of the wire records: `wire_type` names a top-level record on the wire; equality is
    by value."""

    wire_type: ClassVar[str]
    __hash__ = None  # type: ignore[assignment]  # fields hold arrays and dicts

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return all(_values_equal(getattr(self, f.name), getattr(other, f.name))
                   for f in fields(self))  # type: ignore[arg-type]


@dataclass(frozen=True, kw_only=True, eq=False)
class PromptTask(WireRecord):
    """One prompt to roll out (prompts topic); producers sample a group of responses for it."""

    wire_type: ClassVar[str] = "prompt_task"

    task_id: str
    prompt: str
    prompt_token_ids: IntArray | None = array_field(TOKEN_DTYPE, default=None)  # [P]
    reference: str | None = None  # reference answer for the reward function
    epoch: int = 0
    metadata: ScalarMap = field(default_factory=dict)
    created_at: float


@dataclass(frozen=True, kw_only=True, eq=False)
class Sample(WireRecord):
    """One sampled response of a group: token-aligned arrays of equal length T >= 1.

    An episode (1.4) is a sample with a `loss_mask`: `response_token_ids` hold everything after
    the first prompt, the policy's tokens and the observation tokens of every turn, in order;
    observation tokens (mask 0) have version -1 and logprob 0.0 and are context, never trained.
    Not a record of its own (no `wire_type`): it only travels inside a `TrajectoryGroup`.
    """

    response_token_ids: IntArray = array_field(TOKEN_DTYPE)  # [T]
    logprobs: FloatArray = array_field(FLOAT_DTYPE)  # [T] behaviour logprobs, finite, <= 0
    versions: IntArray = array_field(TOKEN_DTYPE)  # [T] policy_version that sampled each token
    reward: float
    token_rewards: FloatArray | None = array_field(FLOAT_DTYPE, default=None)  # [T]
    finish_reason: Literal["stop", "length", "abort"]
    error: str | None = None  # e.g. why the reward function failed (reward is then a fallback)
    loss_mask: MaskArray | None = array_field(MASK_DTYPE, default=None)  # [T] 1: the policy
    # sampled the token (trained), 0: an observation token; None: every token is the policy's
    turn_ends: IntArray | None = array_field(TOKEN_DTYPE, default=None)  # [K] exclusive end of
    # each turn (the policy's span, then the observation after it); increasing, last == T
    episode: ScalarMap = field(default_factory=dict)  # turns, tool_calls, ... (informational)

    @property
    def policy_mask(self) -> npt.NDArray[np.bool_]:
        """[T] bool: the tokens the policy sampled (all of them without a `loss_mask`)."""
        if self.loss_mask is None:
            return np.ones(len(self.response_token_ids), dtype=bool)
        return self.loss_mask != 0  # any dtype: a record built before encode may hold int64

    @property
    def policy_tokens(self) -> int:
        """How many tokens the policy sampled (T without a `loss_mask`)."""
        if self.loss_mask is None:
            return len(self.response_token_ids)
        return int(np.count_nonzero(self.policy_mask))  # the mask the trainer's loss reads

    @property
    def policy_versions(self) -> IntArray:
        """The versions of the policy's tokens (observation tokens' -1 left out), >= 1 entry."""
        if self.loss_mask is None:
            return self.versions
        return self.versions[self.policy_mask]


@dataclass(frozen=True, kw_only=True, eq=False)
class TrajectoryGroup(WireRecord):
    """All samples of one prompt (trajectories topic), atomic so group baselines are exact."""

    wire_type: ClassVar[str] = "trajectory_group"

    group_id: str
    task_id: str
    epoch: int = 0  # the prompt's epoch (PromptTask.epoch); (task_id, epoch) names the prompt
    prompt_token_ids: IntArray = array_field(TOKEN_DTYPE)  # [P]
    samples: list[Sample]
    producer_id: str
    engine: str
    vocab_size: int  # every token id is in [0, vocab_size)
    sampling: ScalarMap = field(default_factory=dict)  # temperature, top_p, top_k, max_new_tokens
    reference: str | None = None
    timings: dict[str, float] = field(default_factory=dict)  # seconds, e.g. {"generate": 1.2}
    created_at: float

    @cached_property
    def min_version(self) -> int:
        """Oldest policy_version that produced any token of the group (policy tokens only)."""
        return min(int(s.policy_versions.min()) for s in self.samples)

    def lag(self, trainer_version: int) -> int:
        """How many optimizer updates the trainer is ahead of the oldest token in the group."""
        return trainer_version - self.min_version


@dataclass(frozen=True, kw_only=True, eq=False)
class WeightVersion(WireRecord):
    """A new policy version the trainer published (control topic); weights go by URI."""

    wire_type: ClassVar[str] = "weight_version"

    policy_version: int
    step: int
    uri: str
    format: Literal["lora", "full"]
    sha256: str  # 64 lowercase hex digits of the file at `uri`
    bytes: int
    base_model: str
    trainer_generation: int = 0  # the announcing trainer's incarnation (fencing; 1.2)
    created_at: float
    signature: bytes | None = None  # Ed25519 over `signed_message` (1.3)


@dataclass(frozen=True, kw_only=True, eq=False)
class Command(WireRecord):
    """An operator command to producers (control topic)."""

    wire_type: ClassVar[str] = "command"

    command: Literal["pause", "resume", "drain", "stop"]
    target: str = ALL_TARGETS  # a producer_id, or "*" for all
    reason: str = ""
    created_at: float
    signature: bytes | None = None  # Ed25519 over `signed_message` (1.3)


@dataclass(frozen=True, kw_only=True, eq=False)
class Heartbeat(WireRecord):
    """Liveness and throughput of one process (status topic)."""

    wire_type: ClassVar[str] = "heartbeat"

    producer_id: str  # the sender's id, whatever its role
    role: str  # "producer", "trainer", ...
    engine: str = ""
    policy_version: int
    in_flight: int = 0
    tokens_per_s: float = 0.0
    trainer_generation: int = 0  # a trainer's incarnation (fencing; 1.2); 0 from producers
    extra: ScalarMap = field(default_factory=dict)
    created_at: float
    signature: bytes | None = None  # Ed25519 over `signed_message` (1.3; the trainer's)


@dataclass(frozen=True, kw_only=True, eq=False)
class DeadLetter(WireRecord):
    """A record a consumer rejected (dlq topic): why, where it came from, and its raw bytes.

    A producer also letters each failed episode (never trained): its source is the prompt the
    episode was played for, its reason `failed_episode_reason(...)`, its payload the episode's
    sample in a `TrajectoryGroup` (empty when no turn was played)."""

    wire_type: ClassVar[str] = "dead_letter"

    reason: str
    source_topic: str
    source_partition: int
    source_offset: int
    payload: bytes  # the rejected bytes (a failed episode's group), capped (limits.py)
    payload_size: int  # length of the payload before truncation
    consumer_group: str | None = None  # the rejecting consumer's group (1.3)
    consumer: str | None = None  # who in the group rejected it, e.g. "producer-0" (1.3)
    created_at: float

    @classmethod
    def for_payload(cls, *, reason: str, source_topic: str, source_partition: int,
                    source_offset: int, payload: bytes | None, created_at: float,
                    consumer_group: str | None = None,
                    consumer: str | None = None) -> "DeadLetter":
        """A dead letter for `payload` (None: a tombstone), truncated to the cap so it always
        fits a record."""
        payload = payload or b""
        kept = bytes(payload[:MAX_DEAD_LETTER_PAYLOAD_BYTES])
        return cls(reason=reason, source_topic=source_topic, source_partition=source_partition,
                   source_offset=source_offset, payload=kept, payload_size=len(payload),
                   consumer_group=consumer_group, consumer=consumer, created_at=created_at)

    @property
    def key(self) -> bytes:
        """The Kafka key of this letter: the same for every letter of one group about one
        record, so readers recognise duplicates (`dead_letter_key`)."""
        return dead_letter_key(self.consumer_group, self.source_topic, self.source_partition,
                               self.source_offset)


def dead_letter_key(group: str | None, topic: str, partition: int, offset: int,
                    part: str | None = None) -> bytes:
    """`<consumer_group>/<source_topic>/<partition>/<offset>` (an empty group when unnamed),
    then `/<part>` for one of several letters about one record (`episode-<i>`: the i-th
    episode played for a prompt)."""
    key = f"{group or ''}/{topic}/{partition}/{offset}"
    return (key if part is None else f"{key}/{part}").encode()


FAILED_EPISODE = "episode failed: "
"""How a failed episode's dead letter reason starts: `episode failed: <kind>: <message>`."""


def failed_episode_reason(failure: str) -> str:
    """The letter reason of an episode that failed with `failure` ("<kind>: <message>")."""
    return FAILED_EPISODE + failure


REJECTED_PROMPT = "prompt rejected: "
"""How the dead letter reason of a prompt the engine cannot take for what it asks starts (its
tokens fill the engine's context, or the engine refused the request): `prompt rejected: <why>`."""


def rejected_prompt_reason(why: str) -> str:
    """The letter reason of a single-turn prompt the engine refused for `why`."""
    return REJECTED_PROMPT + why


def failed_episode_kind(reason: str) -> str | None:
    """The failure kind of a failed episode's letter reason; None for any other reason."""
    if not reason.startswith(FAILED_EPISODE):
        return None
    return reason.removeprefix(FAILED_EPISODE).partition(":")[0].strip() or None


RecordT = TypeVar("RecordT", bound=WireRecord)


def from_checked(record_type: type[RecordT], values: dict[str, object]) -> RecordT:
    """`record_type(**values)` for values the codec has checked; `values` names every field.

    Skips the frozen dataclass `__init__` (an `object.__setattr__` call per field), ~2.5x slower:
    decoding a group builds one `Sample` per response.
    """
    record = object.__new__(record_type)
    record.__dict__.update(values)
    return record


RECORD_TYPES: tuple[type[WireRecord], ...] = (
    PromptTask, TrajectoryGroup, WeightVersion, Command, Heartbeat, DeadLetter)
"""Every top-level record (a `Sample` only travels inside a `TrajectoryGroup`)."""
