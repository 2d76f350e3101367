"""Kafka ACLs per role: what each process of a run may read and write (docs/security.md).

A role's ACLs are for one run (`miles.<run>.*`); `role_acls` lists them and `kafka_acls_commands`
prints the same as `kafka-acls` command lines for a managed cluster. They are what the real
daemons use (tests/kafka/test_secured_run.py runs them on exactly these), nothing more:

- topics: Read on what a role consumes, Write on what it publishes to (Read and Write imply
  Describe). Every role that consumes also writes the run's DLQ (a consumer dead-letters a
  record it cannot use: the one topic a reader writes). An idempotent producer needs Write on a
  topic, not IdempotentWrite on the cluster (Kafka >= 3.0).
- DescribeConfigs: producers check the trajectories topic's record size; `miles topics
  create/describe` (trainer, reader) and range reads (reader) describe the run's topics.
- groups: the trainer uses one group, `miles.<run>.trainer`. Producers' and readers' group ids
  vary (`miles.<run>.<producer_id>.control`, `miles.<run>.replay.<uuid>`, ...), so they get the
  run's group prefix, minus a Deny on the live groups (the trainer's; for readers the
  producers' prompt group too): whoever joins a group can take its partitions and commit its
  offsets, i.e. make the trainer or the producers skip records. A Deny of Read leaves
  Describe, so `miles status` still reads those groups' lag.
- Create on the run's topic prefix for the trainer only (it may create the run's topics).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from miles.config import choose
from miles.protocol.topics import KINDS, topic_name, validate_run_name

Operation = Literal["Read", "Write", "Create", "Describe", "DescribeConfigs"]
TRAINER_GROUP = "trainer"  # miles.<run>.trainer (miles/trainer/loop.py)
PROMPTS_GROUP = "producers"  # miles.<run>.producers, the producers' prompt group (miles/rollout.py)


@dataclass(frozen=True, kw_only=True)
class Acl:
    """One rule: `principal` may (or, Deny, may not) do `operation` on a topic or group."""

    principal: str  # User:<name>
    resource: Literal["topic", "group"]
    name: str
    prefixed: bool = False  # name is a prefix (Kafka's PREFIXED pattern), else literal
    operation: Operation = "Read"
    permission: Literal["Allow", "Deny"] = "Allow"  # a Deny wins over any Allow


@dataclass(frozen=True, kw_only=True)
class Role:
    """What one kind of process does on a run's topics and groups."""

    reads: tuple[str, ...] = ()  # topic kinds it consumes
    writes: tuple[str, ...] = ()  # topic kinds it publishes to
    groups: tuple[str, ...] | None = ()  # its group ids after `miles.<run>.`; None: any
    denied_groups: tuple[str, ...] = ()  # with groups=None: groups it may not join
    describes: tuple[str, ...] = ()  # topic kinds whose configs it reads
    creates: bool = False  # may create the run's topics


ROLES: dict[str, Role] = {
    "trainer": Role(reads=("trajectories",), writes=("control", "status", "dlq"),
                    groups=(TRAINER_GROUP,), describes=KINDS, creates=True),
    "producer": Role(reads=("prompts", "control", "status"),
                     writes=("trajectories", "status", "dlq"), groups=None,
                     denied_groups=(TRAINER_GROUP,), describes=("trajectories",)),
    "feeder": Role(writes=("prompts",)),
    "reader": Role(reads=KINDS, writes=("dlq",), groups=None,
                   denied_groups=(TRAINER_GROUP, PROMPTS_GROUP), describes=KINDS),
}
ROLE_HELP = ("trainer: reads trajectories, writes control and status; producer: reads prompts "
             "and control, writes trajectories and status; feeder: writes prompts; reader "
             "(replay, recorder, evaluator, fan-out, status): reads only, and dead-letters")


def role_acls(role: str, user: str, run: str) -> list[Acl]:
    """The rules of `user` playing `role` in run `run`."""
    spec = choose(ROLES, role, "role")
    validate_run_name(run)
    principal, prefix = f"User:{user}", f"miles.{run}."

    def topics(operation: Operation, kinds: tuple[str, ...]) -> list[Acl]:
        if kinds == KINDS and operation == "DescribeConfigs":  # all of them: one prefix rule
            return [Acl(principal=principal, resource="topic", name=prefix, prefixed=True,
                        operation=operation)]
        return [Acl(principal=principal, resource="topic", name=topic_name(run, kind),
                    operation=operation) for kind in kinds]

    acls = topics("Read", spec.reads) + topics("Write", spec.writes)
    if spec.groups is None:
        acls.append(Acl(principal=principal, resource="group", name=prefix, prefixed=True))
        acls += [Acl(principal=principal, resource="group", name=prefix + group,
                     permission="Deny") for group in spec.denied_groups]
    else:
        acls += [Acl(principal=principal, resource="group", name=prefix + group)
                 for group in spec.groups]
    acls += topics("DescribeConfigs", spec.describes)
    if spec.creates:
        acls.append(Acl(principal=principal, resource="topic", name=prefix, prefixed=True,
                        operation="Create"))
    return acls


def kafka_acls_commands(acls: list[Acl], *, bootstrap: str = "BROKER:9093",
                        command_config: str = "admin.properties") -> list[str]:
    """The `kafka-acls` commands that create `acls` (one per rule, for readability)."""
    lines = []
    for acl in acls:
        pattern = " --resource-pattern-type prefixed" if acl.prefixed else ""
        lines.append(f"kafka-acls --bootstrap-server {bootstrap} --command-config "
                     f"{command_config} --add --{acl.permission.lower()}-principal "
                     f"{acl.principal} --operation {acl.operation} --{acl.resource} "
                     f"'{acl.name}'{pattern}")
    return lines
