"""Kafka ACLs per role: what each process of a run may read and write (docs/security.md).

A role's ACLs are for one run (`miles.<run>.*`); `role_acls` lists them and `kafka_acls_commands`
prints the same as `kafka-acls` command lines for a managed cluster. Consumer groups of a run
all start with `miles.<run>.`, so one prefixed group ACL covers a role's groups. Every role that
consumes also writes the run's DLQ: a consumer dead-letters a record it cannot use (the DLQ is
the one topic a reader writes). Read and Write imply Describe; topic configs need
DescribeConfigs (producers check the trajectories topic's record size). An idempotent producer
needs Write on a topic, not IdempotentWrite on the cluster (Kafka >= 3.0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from miles.config import choose
from miles.protocol.topics import topic_name, validate_run_name

Operation = Literal["Read", "Write", "Create", "Describe", "DescribeConfigs"]


@dataclass(frozen=True, kw_only=True)
class Acl:
    """One allow rule: `principal` may do `operation` on a topic or group (name or prefix)."""

    principal: str  # User:<name>
    resource: Literal["topic", "group"]
    name: str
    prefixed: bool = False  # name is a prefix (Kafka's PREFIXED pattern), else literal
    operation: Operation = "Read"


# role -> (reads, writes) topic kinds, and whether it creates the run's topics
ROLES: dict[str, tuple[tuple[str, ...], tuple[str, ...], bool]] = {
    "trainer": (("trajectories", "control", "status"), ("control", "status", "dlq"), True),
    "producer": (("prompts", "control", "status"), ("trajectories", "status", "dlq"), False),
    "feeder": ((), ("prompts",), False),
    "reader": (("prompts", "trajectories", "control", "status", "dlq"), ("dlq",), False),
}
ROLE_HELP = ("trainer: writes control; producer: reads prompts and control, writes "
             "trajectories and status; feeder: writes prompts; reader (replay, recorder, "
             "evaluator, fan-out, status): reads only, and dead-letters")


def role_acls(role: str, user: str, run: str) -> list[Acl]:
    """The allow rules of `user` playing `role` in run `run`."""
    reads, writes, creates = choose(ROLES, role, "role")
    validate_run_name(run)
    principal, prefix = f"User:{user}", f"miles.{run}."
    acls = [Acl(principal=principal, resource="topic", name=topic_name(run, kind),
                operation=operation)
            for operation, kinds in (("Read", reads), ("Write", writes)) for kind in kinds]
    if reads:
        acls.append(Acl(principal=principal, resource="group", name=prefix, prefixed=True))
        acls.append(Acl(principal=principal, resource="topic", name=prefix, prefixed=True,
                        operation="DescribeConfigs"))
    if creates:
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
                     f"{command_config} --add --allow-principal {acl.principal} --operation "
                     f"{acl.operation} --{acl.resource} '{acl.name}'{pattern}")
    return lines
