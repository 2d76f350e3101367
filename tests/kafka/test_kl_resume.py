"""The adaptive KL coefficient across a real trainer restart on the real broker: the first
trainer process trains two steps under the adaptive controller (Ziegler et al. 2019) and exits
with its checkpoint; the second resumes from it, and every step's `trainer/kl_coef` in
metrics.jsonl is the controller's next coefficient after the step before it, across the restart
too (not `loss.kl_coef` again)."""

from __future__ import annotations

import pytest

from miles.rl.kl import adaptive_kl_coef
from tests.conftest import unique_run
from tests.kafka.test_rl_processes import spawn, trainer_settings, wait_exit
from tests.kafka.test_trainer_faults import PER_STEP, metrics, publish_groups

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
KL_COEF, KL_TARGET, KL_HORIZON = 0.1, 1e-3, 16.0  # 16 responses a step: K_beta = 1
RESPONSES = PER_STEP * 4  # publish_groups: 4 samples a group, every one with trained tokens
ADAPTIVE = [f"learner.algorithm.loss.kl_coef={KL_COEF}",
            f"learner.algorithm.loss.kl_target={KL_TARGET}",
            f"learner.algorithm.loss.kl_horizon={KL_HORIZON}"]


async def test_a_restarted_trainer_continues_the_adapted_kl_coefficient(
        kafka_broker, model_dir, tmp_path):
    run, first_steps, steps = unique_run(), 2, 4
    await publish_groups(kafka_broker.url, run, 0, PER_STEP * steps)
    out = tmp_path / "out"
    for name, max_steps in (("first", first_steps), ("second", steps)):
        trainer = spawn("consumers.trainer", trainer_settings(
            kafka_broker.url, run, model_dir, out, groups_per_step=PER_STEP,
            max_steps=max_steps, max_staleness=1000, checkpoint_every=1) + ADAPTIVE,
            tmp_path / f"{name}.log")
        wait_exit(trainer, tmp_path / f"{name}.log", 240)
    lines = metrics(out)
    assert [m["step"] for m in lines] == list(range(1, steps + 1))
    assert lines[0]["trainer/kl_coef"] == KL_COEF
    for before, after in zip(lines, lines[1:]):
        expected = adaptive_kl_coef(before["trainer/kl_coef"], kl=before["trainer/kl_response"],
                                    target=KL_TARGET, samples=RESPONSES, horizon=KL_HORIZON)
        assert after["trainer/kl_coef"] == pytest.approx(expected, rel=1e-9), \
            f"step {after['step']}: {[m['trainer/kl_coef'] for m in lines]}"
    assert lines[first_steps]["trainer/kl_coef"] != KL_COEF, "restarted from loss.kl_coef"
    log_text = (tmp_path / "second.log").read_text()
    assert f"resumed at step {first_steps}" in log_text
    assert "adaptive KL coefficient resumed at" in log_text
