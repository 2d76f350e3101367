"""What the trainer computes from a batch of trajectory groups, and the named presets.

`AlgorithmConfig` chooses the advantage estimator, the policy loss (`LossSettings`: objective,
aggregation, behaviour correction, KL and entropy terms), the critic settings of PPO and the
DAPO batch pieces. A preset is a partial config (a mapping of field overrides), applied as the
lowest config layer (`miles train --algo dapo --set learner.algorithm.loss.clip_high=0.3` starts
from DAPO and overrides one field). `name` records the preset; naming it in a file or `--set`
chooses the preset just as `--algo` does (`parse_config_args`). `miles algorithms` prints `PRESETS`.

The KL to the reference enters either the loss (`loss.kl_coef` x the `loss.kl_kind` estimate,
as GRPO does) or, with `kl_in_reward`, the reward (`loss.kl_coef` x the k1 KL of the sampling
policy per token: InstructGPT with the critic; RLOO and REINFORCE++ without), never both
(`policy_loss_settings`); `loss.kl_target` makes the coefficient adaptive (Ziegler et al. 2019).

Simplifications:
- Presets differ from their papers where a paper's setting only matters at a scale we cannot
  test here; each summary says so. No preset uses a KL term by default: on verifiable rewards
  DAPO and Dr. GRPO found it unnecessary, and it costs a reference forward per micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from miles.errors import ConfigError
from miles.rl.advantages import ADVANTAGE_ESTIMATORS, AdvantageSettings
from miles.rl.losses import LossSettings

ESTIMATORS = (*ADVANTAGE_ESTIMATORS, "gae")


@dataclass(frozen=True, kw_only=True)
class AlgorithmConfig:
    """How a batch of groups becomes a loss (see the presets for coherent combinations)."""

    name: str = "grpo"  # the preset the other fields start from (one of PRESETS; like --algo)
    estimator: str = "grpo"  # advantages: grpo, dr_grpo, rloo, reinforce_pp, or gae (critic)
    advantage: AdvantageSettings = field(default_factory=AdvantageSettings)  # estimator knobs
    loss: LossSettings = field(default_factory=LossSettings)  # objective, aggregation, IS, KL
    mini_batches: int = 1  # optimizer updates per pass over the batch (groups split evenly)
    ppo_epochs: int = 1  # passes over the batch; updates per step = ppo_epochs x mini_batches
    # (> 1 update: proximal logprobs and old values are scored once, before the first)
    kl_in_reward: bool = False  # loss.kl_coef * k1 KL per token enters the reward instead of
    # the loss (gae: per-token rewards; critic-free: before the estimator)
    gamma: float = 1.0  # gae discount
    lam: float = 0.95  # gae lambda
    value_coef: float = 0.5  # weight of the critic's value loss
    value_clip: float = 0.2  # clip of new values around the pre-update values (0: off)
    critic_warmup_steps: int = 0  # first steps train only the critic
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal, refill
    overlong_buffer: int = 0  # DAPO: responses longer than max_new_tokens - this get penalised
    overlong_penalty: float = 1.0  # DAPO: penalty at max_new_tokens, ramping linearly from 0
    mask_truncated: bool = False  # responses cut at max_new_tokens get no loss

    def __post_init__(self) -> None:
        checks = [
            (self.name in PRESETS,
             f"name must be one of {sorted(PRESETS)} (a preset), got {self.name!r}"),
            (self.estimator in ESTIMATORS,
             f"estimator must be one of {list(ESTIMATORS)}, got {self.estimator!r}"),
            (self.mini_batches >= 1,
             f"mini_batches must be >= 1, got {self.mini_batches}"),
            (self.ppo_epochs >= 1, f"ppo_epochs must be >= 1, got {self.ppo_epochs}"),
            (not self.kl_in_reward or self.loss.kl_coef > 0,
             "kl_in_reward needs loss.kl_coef > 0 (the penalty's weight), got loss.kl_coef="
             f"{self.loss.kl_coef}"),
            (not (self.kl_in_reward and self.estimator == "reinforce_pp")
             or self.advantage.normalise_over == "tokens",
             "kl_in_reward under estimator='reinforce_pp' gives per-token returns, normalised "
             "over tokens: advantage.normalise_over must be 'tokens', got "
             f"{self.advantage.normalise_over!r}"),
            (0 < self.gamma <= 1, f"gamma must be in (0, 1], got {self.gamma}"),
            (0 <= self.lam <= 1, f"lam must be in [0, 1], got {self.lam}"),
            (self.value_coef > 0, f"value_coef must be > 0, got {self.value_coef}"),
            (self.value_clip >= 0, f"value_clip must be >= 0, got {self.value_clip}"),
            (self.critic_warmup_steps >= 0, "critic_warmup_steps must be >= 0, "
             f"got {self.critic_warmup_steps}"),
            (self.overlong_buffer >= 0,
             f"overlong_buffer must be >= 0, got {self.overlong_buffer}"),
            (self.overlong_penalty >= 0,
             f"overlong_penalty must be >= 0, got {self.overlong_penalty}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        self.advantage.check(self.estimator)

    def policy_loss_settings(self, kl_coef: float | None = None) -> LossSettings:
        """The settings of the policy loss: `loss` with the KL term's coefficient `kl_coef` (the
        adaptive controller's current one; None: loss.kl_coef), and no KL term at all under
        kl_in_reward, where the KL is in the reward."""
        if self.kl_in_reward:
            return replace(self.loss, kl_coef=0.0, kl_target=None)
        if kl_coef is None or kl_coef == self.loss.kl_coef:
            return self.loss
        return replace(self.loss, kl_coef=kl_coef)

    @property
    def uses_critic(self) -> bool:
        return self.estimator == "gae"

    @property
    def uses_reference(self) -> bool:
        return self.loss.kl_coef > 0

    @property
    def advantage_only(self) -> bool:
        """Every term of the loss is the sample's outcome advantage times something finite: no
        critic, no KL and no entropy term. A sample whose advantage is 0 then adds exactly
        nothing to the gradient (only to the normalisers)."""
        return not self.uses_critic and self.loss.kl_coef == 0 and self.loss.entropy_coef == 0


@dataclass(frozen=True)
class Preset:
    summary: str  # what it computes, in a line or two
    paper: str  # where it comes from
    overrides: dict  # AlgorithmConfig fields (nested `loss` as a dict)


PRESETS: dict[str, Preset] = {
    "ppo": Preset(
        "GAE advantages from a learned critic (LoRA adapter + value head on the actor's base), "
        "whitened over the batch; PPO-clip actor loss, clipped value loss.",
        "Schulman et al. 2017 (PPO); Ouyang et al. 2022 (InstructGPT)",
        {"estimator": "gae", "lam": 0.95, "gamma": 1.0, "value_clip": 0.2,
         "ppo_epochs": 4, "mini_batches": 1,
         "loss": {"clip_low": 0.2, "clip_high": 0.2}}),
    "grpo": Preset(
        "Group-normalised outcome reward (mean and std over the n samples of a prompt); "
        "PPO-clip, token mean over the batch (the paper's per-sequence mean and KL loss are "
        "options: loss.aggregation, loss.kl_coef).",
        "Shao et al. 2024 (DeepSeekMath)",
        {"estimator": "grpo", "ppo_epochs": 1, "mini_batches": 1,
         "loss": {"clip_low": 0.2, "clip_high": 0.28}}),
    "dr_grpo": Preset(
        "Group-centred reward without the std division; per-sequence token sums over a constant "
        "(max_new_tokens), so neither length nor difficulty reweights the gradient.",
        "Liu et al. 2025 (Understanding R1-Zero-like training)",
        {"estimator": "dr_grpo", "loss": {"aggregation": "seq_sum_constant"}}),
    "dapo": Preset(
        "GRPO advantages; asymmetric clip (0.2 / 0.28), token mean, dynamic sampling (groups "
        "with equal rewards dropped and refilled), overlong reward shaping.",
        "Yu et al. 2025 (DAPO)",
        {"estimator": "grpo", "dynamic_sampling": True, "overlong_buffer": 2,
         "overlong_penalty": 1.0, "ppo_epochs": 1, "mini_batches": 16,
         "loss": {"clip_low": 0.2, "clip_high": 0.28}}),
    "gspo": Preset(
        "GRPO advantages; sequence-level ratio (geometric mean of token ratios) clipped at "
        "3e-4 / 4e-4, sequence mean of token means; the behaviour correction at the same "
        "(geometric) sequence level.",
        "Zheng et al. 2025 (GSPO)",
        {"estimator": "grpo", "ppo_epochs": 1, "mini_batches": 4,
         "loss": {"objective": "gspo", "aggregation": "seq_mean_token_mean",
                  "is_level": "geometric"}}),
    "cispo": Preset(
        "GRPO advantages; REINFORCE on every token weighted by the detached IS ratio, capped "
        "at 1 + eps_high = 2, no floor (the paper's: no lower bound), token mean.",
        "MiniMax 2025 (MiniMax-M1)",
        {"estimator": "grpo", "ppo_epochs": 1, "mini_batches": 2,
         "loss": {"objective": "cispo", "cispo_eps_low": None, "cispo_eps_high": 1.0}}),
    "rloo": Preset(
        "Leave-one-out baseline (mean of the other n - 1 rewards), no std scaling; PPO-clip, "
        "token mean.",
        "Ahmadian et al. 2024 (Back to basics)",
        {"estimator": "rloo", "loss": {"clip_low": 0.2, "clip_high": 0.2}}),
    "reinforce_pp": Preset(
        "Outcome reward normalised by the mean and std over the tokens of the whole batch (no "
        "per-prompt baseline; advantage.baseline: REINFORCE++-baseline); PPO-clip, token mean "
        "(the paper's KL in the reward: kl_in_reward with loss.kl_coef, off by default).",
        "Hu 2025 (REINFORCE++)",
        {"estimator": "reinforce_pp", "loss": {"clip_low": 0.2, "clip_high": 0.2}}),
}


def preset_layers() -> dict[str, dict]:
    """Every preset's fields with its name recorded (`config.load_with_preset`'s `presets`)."""
    return {name: preset(name) for name in PRESETS}


def preset(name: str) -> dict:
    """The overrides of preset `name`, with `name` itself recorded."""
    if name not in PRESETS:
        raise ConfigError(f"algo must be one of {sorted(PRESETS)}, got {name!r}")
    return {"name": name, **PRESETS[name].overrides}
