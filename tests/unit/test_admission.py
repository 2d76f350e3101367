"""Producer admission control keeps generated groups within the staleness bound."""

import pytest

from miles.admission import TrainerView, admissible, admitted


@pytest.mark.parametrize("loaded, trainer_version, in_flight, batch, per_step, bound, expected", [
    (0, 0, 0, 8, 8, 0, True),     # on-policy: one step's worth at the trainer's version
    (0, 0, 8, 8, 8, 0, False),    # a second step's worth would be trained at version 1
    (0, 1, 0, 8, 8, 0, False),    # the trainer moved on: load version 1 first
    (1, 1, 0, 8, 8, 0, True),
    (0, 0, 8, 8, 8, 1, True),     # one version of slack admits one step ahead
    (0, 0, 16, 8, 8, 1, False),
    (3, 3, 0, 32, 8, 2, False),   # a batch of four steps' worth reaches lag 3 at its end
    (3, 3, 0, 24, 8, 2, True),
    (2, 0, -5, 8, 8, 0, True),    # negative in-flight (stale heartbeat) counts as zero
])
def test_admission(loaded, trainer_version, in_flight, batch, per_step, bound, expected):
    trainer = TrainerView(policy_version=trainer_version)
    assert admitted(loaded_version=loaded, trainer=trainer, in_flight=in_flight, batch=batch,
                    groups_per_step=per_step, max_staleness=bound) is expected


def test_the_trainer_view_follows_the_newest_generation():
    trainer = TrainerView(policy_version=7, generation=1)
    assert trainer.follow(1, 5) and trainer.policy_version == 7  # within one: only grows
    assert trainer.follow(2, 3) and (trainer.generation, trainer.policy_version) == (2, 3)
    assert not trainer.follow(1, 9) and trainer.policy_version == 3  # a fenced trainer


@pytest.mark.parametrize("loaded, in_flight, most, per_step, bound, expected", [
    (0, 0, 4, 1, 0, 1),   # on-policy, one group per step: only the next group is fresh
    (0, 0, 4, 4, 0, 4),   # four groups fill version 0's step
    (0, 3, 4, 4, 0, 1),   # three in flight leave one place in the step
    (0, 4, 4, 4, 0, 0),   # the step is full: wait for the trainer
    (0, 4, 8, 4, 1, 4),   # one version of slack: the next step's four
    (1, 4, 8, 4, 0, 4),   # a newer version loaded: its step
])
def test_a_streaming_producer_takes_only_the_groups_each_fresh_enough(
        loaded, in_flight, most, per_step, bound, expected):
    assert admissible(loaded_version=loaded, trainer=TrainerView(), in_flight=in_flight,
                      most=most, groups_per_step=per_step, max_staleness=bound) == expected
