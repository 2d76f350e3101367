"""The ACLs per role (`miles.acls`), as rules and as `kafka-acls` commands. That they are enough
for the real daemons is tests/kafka/test_secured_run.py; that the rest is refused,
tests/kafka/test_secured_broker.py."""

import pytest

from miles.acls import kafka_acls_commands, role_acls
from miles.errors import ConfigError


def rules(role: str) -> set[tuple[str, str, str, str]]:
    return {(acl.permission, acl.operation, acl.resource,
             acl.name + ("*" if acl.prefixed else "")) for acl in role_acls(role, "u", "r")}


def test_the_trainer_reads_trajectories_and_uses_its_own_group_only():
    assert rules("trainer") == {
        ("Allow", "Read", "topic", "miles.r.trajectories"),
        *{("Allow", "Write", "topic", f"miles.r.{kind}") for kind in ("control", "status", "dlq")},
        ("Allow", "Read", "group", "miles.r.trainer"),
        ("Allow", "DescribeConfigs", "topic", "miles.r.*"),
        ("Allow", "Create", "topic", "miles.r.*")}


def test_only_the_trainer_writes_control_and_only_the_live_daemons_join_their_groups():
    for role in ("producer", "feeder", "reader"):
        assert ("Allow", "Write", "topic", "miles.r.control") not in rules(role)
    assert ("Deny", "Read", "group", "miles.r.trainer") in rules("producer")
    assert {("Deny", "Read", "group", "miles.r.trainer"),
            ("Deny", "Read", "group", "miles.r.producers")} <= rules("reader")
    assert ("Allow", "DescribeConfigs", "topic", "miles.r.trajectories") in rules("producer")
    assert rules("feeder") == {("Allow", "Write", "topic", "miles.r.prompts")}


def test_commands_spell_allow_deny_and_prefixes():
    lines = kafka_acls_commands(role_acls("reader", "bob", "r"))
    assert ("--add --deny-principal User:bob --operation Read --group 'miles.r.trainer'"
            in "\n".join(lines))
    assert any(line.endswith("--group 'miles.r.' --resource-pattern-type prefixed")
               and "--allow-principal" in line for line in lines)


def test_an_unknown_role_names_the_choices():
    with pytest.raises(ConfigError, match="unknown role 'admin'; valid choices: feeder"):
        role_acls("admin", "u", "r")
