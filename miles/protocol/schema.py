"""What each record looks like on the wire: one reader per record type, and the type registry.

A reader takes a `FieldReader` over a record's map and returns the record, checking every field
(presence, type, range) and the relations between fields (sibling array lengths, token ids
against `vocab_size`). The codec runs the same reader on decode and, before packing, on encode,
so there is exactly one definition of a valid record. Fields a reader does not ask for are
ignored (forward compatibility within a major schema version).

Decoding a `TrajectoryGroup` is the hot path (16+ samples per record), so it has a fast path:
`read_plain_sample` reads a sample as `encode` writes it with a few `type() is` tests and builds
it with `from_checked`, and falls back to the general `read_sample` (which names the problem, or
accepts a valid sample written differently) on anything else. The array values of a group are
checked once over all samples' arrays (`check_group_values`), after every field was read; an
episode's (1.4: `loss_mask`, `turn_ends`) by `miles.protocol.episodes`, one sample at a time.
"""

import math
import re
from collections.abc import Callable

from miles.errors import CodecError
from miles.protocol.arrays import FINITE, LOGPROBS, VERSIONS, token_ids_rule
from miles.protocol.episodes import check_episode
from miles.protocol.fields import ArraySpec, FieldReader, preview
from miles.protocol.limits import (FLOAT_DTYPE, MASK_DTYPE, MAX_DEAD_LETTER_PAYLOAD_BYTES,
                                   MAX_EPISODE_ENTRIES, MAX_GENERATION, MAX_POLICY_VERSION,
                                   MAX_SAMPLES_PER_GROUP,
                                   MAX_TOKENS_PER_SEQUENCE, MAX_VOCAB_SIZE, SIGNATURE_BYTES,
                                   TOKEN_DTYPE)
from miles.protocol.records import (ALL_TARGETS, COMMANDS, FINISH_REASONS, WEIGHT_FORMATS, Command,
                                    DeadLetter, Heartbeat, IntArray, PromptTask, Sample,
                                    TrajectoryGroup, WeightVersion, WireRecord, from_checked)

_SHA256 = re.compile(r"[0-9a-f]{64}")
TOKENS = ArraySpec(TOKEN_DTYPE, max_len=MAX_TOKENS_PER_SEQUENCE)
"""Token ids and per-token versions: int32, 1 to MAX_TOKENS_PER_SEQUENCE long."""
FLOATS = ArraySpec(FLOAT_DTYPE, max_len=MAX_TOKENS_PER_SEQUENCE)
"""Logprobs and per-token rewards: float32, 1 to MAX_TOKENS_PER_SEQUENCE long."""
MASKS = ArraySpec(MASK_DTYPE, max_len=MAX_TOKENS_PER_SEQUENCE)
"""An episode's loss mask (1.4): uint8, as long as its response."""


def _created_at(r: FieldReader) -> float:
    return r.number("created_at", lo=0.0)


def _sha256(r: FieldReader) -> str:
    digest = r.string("sha256")
    if not _SHA256.fullmatch(digest):
        raise CodecError(r.path("sha256"),
                         f"must be 64 lowercase hex digits, got {preview(digest)}")
    return digest


def _signature(r: FieldReader) -> bytes | None:
    if r.absent("signature"):
        return None
    signature = r.blob("signature", max_len=SIGNATURE_BYTES)
    if len(signature) != SIGNATURE_BYTES:
        raise CodecError(r.path("signature"),
                         f"must be {SIGNATURE_BYTES} bytes, got {len(signature)}")
    return signature


def read_prompt_task(r: FieldReader) -> PromptTask:
    ids = r.array("prompt_token_ids", TOKENS, default=None)
    if ids is not None:
        token_ids_rule(MAX_VOCAB_SIZE).check(ids, r.path("prompt_token_ids"))
    return PromptTask(
        task_id=r.string("task_id", nonempty=True),
        prompt=r.string("prompt"),
        prompt_token_ids=ids,
        reference=r.string("reference", default=None),
        epoch=r.integer("epoch", lo=0, default=0),
        metadata=r.scalar_map("metadata"),
        created_at=_created_at(r),
    )


def read_sample(r: FieldReader) -> Sample:
    """A sample's fields and array lengths; the array values are checked group-wide."""
    ids = r.array("response_token_ids", TOKENS)
    same = ("response_token_ids", len(ids))
    return Sample(
        response_token_ids=ids,
        logprobs=r.array("logprobs", FLOATS, same_length_as=same),
        versions=r.array("versions", TOKENS, same_length_as=same),
        reward=r.number("reward"),
        token_rewards=r.array("token_rewards", FLOATS, same_length_as=same, default=None),
        finish_reason=r.string("finish_reason", choices=FINISH_REASONS),
        error=r.string("error", default=None),
        loss_mask=r.array("loss_mask", MASKS, same_length_as=same, default=None),
        turn_ends=r.array("turn_ends", TOKENS, default=None),
        episode=read_episode(r),
    )


def read_plain_sample(data: object) -> Sample | None:
    """The sample in map `data` if it is plain, else None.

    Plain: valid, in the form `encode` writes (a float `reward`). The fast path of decode, as
    reading the samples is ~40% of a group's decode time: the checks of `read_sample` without
    per-field reader calls, paths or the dataclass `__init__`. On None, `read_sample` names what
    is wrong, or reads a valid sample that is not plain (an int `reward`).
    """
    if type(data) is not dict:
        return None
    ids = TOKENS.view(data.get("response_token_ids"))
    if ids is None:
        return None
    n = len(ids)
    logprobs, versions = FLOATS.view(data.get("logprobs"), n), TOKENS.view(data.get("versions"), n)
    rewards, mask, ends = data.get("token_rewards"), data.get("loss_mask"), data.get("turn_ends")
    token_rewards = None if rewards is None else FLOATS.view(rewards, n)
    loss_mask = None if mask is None else MASKS.view(mask, n)
    turn_ends = None if ends is None else TOKENS.view(ends)
    reward, finish_reason, error = data.get("reward"), data.get("finish_reason"), data.get("error")
    if (logprobs is None or versions is None or (rewards is not None and token_rewards is None)
            or (mask is not None and loss_mask is None) or (ends is not None and turn_ends is None)
            or type(reward) is not float or not math.isfinite(reward)
            or finish_reason not in FINISH_REASONS  # only a str can equal one of them
            or not (error is None or type(error) is str)):
        return None
    episode = data.get("episode")
    if episode is None:
        episode = {}
    elif (episode := _plain_scalar_map(episode)) is None:
        return None
    return from_checked(Sample, {
        "response_token_ids": ids, "logprobs": logprobs, "versions": versions, "reward": reward,
        "token_rewards": token_rewards, "finish_reason": finish_reason, "error": error,
        "loss_mask": loss_mask, "turn_ends": turn_ends, "episode": episode})


def _plain_scalar_map(value: object) -> dict | None:
    """An episode map as `read_episode` reads it, None if it is not valid (the general reader
    then names the problem with its path)."""
    try:
        return read_episode(FieldReader({"episode": value}))
    except CodecError:
        return None


def read_episode(r: FieldReader) -> dict:
    """A sample's `episode` map (1.4): at most MAX_EPISODE_ENTRIES scalars."""
    return r.scalar_map("episode", max_entries=MAX_EPISODE_ENTRIES, bound="MAX_EPISODE_ENTRIES")


def read_samples(r: FieldReader) -> list[Sample]:
    """The samples of a group, each by `read_plain_sample`, else by `read_sample`."""
    samples = []
    for i, item in enumerate(r.elements("samples", min_len=1, max_len=MAX_SAMPLES_PER_GROUP)):
        sample = read_plain_sample(item)
        samples.append(read_sample(r.element("samples", i, item)) if sample is None else sample)
    return samples


def check_group_values(prompt_ids: IntArray, samples: list[Sample], vocab_size: int) -> None:
    """The value rules of the group's arrays, each tested once over all arrays of its kind (the
    prompt's token ids with the responses'): numpy's cost per call, not per element, dominates."""
    ids, logprobs, versions, rewarded, plain, episodes = [prompt_ids], [], [], [], [], []
    for i, s in enumerate(samples):
        ids.append(s.response_token_ids)
        logprobs.append(s.logprobs)
        if s.loss_mask is None:
            versions.append(s.versions)
            plain.append(i)
        if s.token_rewards is not None:
            rewarded.append(i)
        if s.loss_mask is not None or s.turn_ends is not None:
            episodes.append(i)
    token_ids_rule(vocab_size).check_all(
        ids, lambda k: f"samples[{k - 1}].response_token_ids" if k else "prompt_token_ids")
    LOGPROBS.check_all(logprobs, lambda k: f"samples[{k}].logprobs")
    if versions:
        VERSIONS.check_all(versions, lambda k: f"samples[{plain[k]}].versions")
    for i in episodes:  # masked versions: -1 exactly on observation tokens
        check_episode(samples[i], f"samples[{i}]")
    if rewarded:
        FINITE.check_all([samples[i].token_rewards for i in rewarded],
                         lambda k: f"samples[{rewarded[k]}].token_rewards")


def read_trajectory_group(r: FieldReader) -> TrajectoryGroup:
    vocab_size = r.integer("vocab_size", lo=1, hi=MAX_VOCAB_SIZE)
    prompt_ids = r.array("prompt_token_ids", TOKENS)
    samples = read_samples(r)
    check_group_values(prompt_ids, samples, vocab_size)
    return from_checked(TrajectoryGroup, dict(
        group_id=r.string("group_id", nonempty=True),
        task_id=r.string("task_id", nonempty=True),
        epoch=r.integer("epoch", lo=0, default=0),
        prompt_token_ids=prompt_ids,
        samples=samples,
        producer_id=r.string("producer_id", nonempty=True),
        engine=r.string("engine", nonempty=True),
        vocab_size=vocab_size,
        sampling=r.scalar_map("sampling"),
        reference=r.string("reference", default=None),
        timings=r.float_map("timings"),
        created_at=_created_at(r),
    ))


def read_weight_version(r: FieldReader) -> WeightVersion:
    return WeightVersion(
        policy_version=r.integer("policy_version", lo=0, hi=MAX_POLICY_VERSION),
        step=r.integer("step", lo=0),
        uri=r.string("uri", nonempty=True),
        format=r.string("format", choices=WEIGHT_FORMATS),
        sha256=_sha256(r),
        bytes=r.integer("bytes", lo=0),
        base_model=r.string("base_model", nonempty=True),
        trainer_generation=r.integer("trainer_generation", lo=0, hi=MAX_GENERATION, default=0),
        created_at=_created_at(r),
        signature=_signature(r),
    )


def read_command(r: FieldReader) -> Command:
    return Command(
        command=r.string("command", choices=COMMANDS),
        target=r.string("target", nonempty=True, default=ALL_TARGETS),
        reason=r.string("reason", default=""),
        created_at=_created_at(r),
        signature=_signature(r),
    )


def read_heartbeat(r: FieldReader) -> Heartbeat:
    return Heartbeat(
        producer_id=r.string("producer_id", nonempty=True),
        role=r.string("role", nonempty=True),
        engine=r.string("engine", default=""),
        policy_version=r.integer("policy_version", lo=0, hi=MAX_POLICY_VERSION),
        in_flight=r.integer("in_flight", lo=0, default=0),
        tokens_per_s=r.number("tokens_per_s", lo=0.0, default=0.0),
        trainer_generation=r.integer("trainer_generation", lo=0, hi=MAX_GENERATION, default=0),
        extra=r.scalar_map("extra"),
        created_at=_created_at(r),
        signature=_signature(r),
    )


def read_dead_letter(r: FieldReader) -> DeadLetter:
    payload = r.blob("payload", max_len=MAX_DEAD_LETTER_PAYLOAD_BYTES)
    return DeadLetter(
        reason=r.string("reason", nonempty=True),
        source_topic=r.string("source_topic"),
        source_partition=r.integer("source_partition", lo=0),
        source_offset=r.integer("source_offset", lo=0),
        payload=payload,
        payload_size=r.integer("payload_size", lo=len(payload)),
        consumer_group=r.string("consumer_group", default=None),
        consumer=r.string("consumer", default=None),
        created_at=_created_at(r),
    )


READERS: dict[type[WireRecord], Callable[[FieldReader], WireRecord]] = {
    PromptTask: read_prompt_task,
    TrajectoryGroup: read_trajectory_group,
    WeightVersion: read_weight_version,
    Command: read_command,
    Heartbeat: read_heartbeat,
    DeadLetter: read_dead_letter,
}
"""The reader of every top-level record type."""

TYPES_BY_NAME: dict[str, type[WireRecord]] = {cls.wire_type: cls for cls in READERS}
"""Record class of each wire `type` name."""
