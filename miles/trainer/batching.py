"""Trajectory groups -> padded micro-batches under a token budget.

A row is one sample: prompt + response, right-padded. Logits at position t predict token t+1,
so the per-token tensors (`response_mask`, `behaviour_logprobs`) are aligned with the targets
`input_ids[:, 1:]` and have length L - 1. Outcome advantages are computed from the recorded
rewards of the whole batch (`outcome_advantages`: reward shaping, then the configured estimator)
before the samples are spread over micro-batches.

Two layouts of a micro-batch for the model:
- padded: one right-padded model row per sample, `attention_mask` marks the real tokens;
- packed (`packed=True`): samples placed first-fit into model rows ("lines") as long as the
  longest sample, `position_ids` restarting at 0 for each sample (and for a line's trailing
  padding), no `attention_mask`. Hugging Face models built on `transformers.masking_utils`
  (Llama, Qwen2, Mistral, Gemma, ...) read restarting positions as separate sequences
  (block-diagonal causal attention), so little compute goes to padding, and no line is longer
  than a padded row would be (attention's cost per line stays that of the longest sample).
- shared prompts (packed, `share_width` > 0: `LearnerConfig.share_prompts`): a group's samples
  in one line after a single copy of their prompt, where that saves compute (`sharing_pays`:
  the prompt's projections computed once against the longer line's attention). Each response
  restarts its positions at the prompt's length and attends to the prompt and to itself
  causally: a [R, 1, T, T] boolean `attention_mask` (`visibility`) that Hugging Face models
  take as given (checked at start, `miles.trainer.model.shared_prompts_supported`). The
  prompt's last position predicts every response's first token, so each sample's targets
  (`sample_targets`) are gathered at its own positions (`layout`). Forward and backward are
  the separate samples' (the prompt's gradient is the sum over its responses).
Either way the per-token tensors the loss reads (`response_mask`, `behaviour_logprobs`, and what
`MicroBatch.unpack` returns) have the padded [B, L-1] layout, one row per sample, so every loss
aggregation sees the same rows under both layouts.

Simplifications:
- The budget counts the tokens of a forward, model rows x longest model row, what activation
  memory scales with. Samples (padded) or lines (packed) are sorted longest first and filled
  into micro-batches in order. A single sample longer than the budget gets a micro-batch of its
  own: the budget is a target, and a long sample is trained rather than dropped. (The trainer
  loop admits no such sample: `miles.trainer.intake` dead-letters a group with a row over the
  budget before it reaches a batch.)
- One sampling setting (temperature, top_k, top_p) per micro-batch: rows are split by setting
  first, so a batch mixing settings gives more, smaller micro-batches, never an error.
- Outcome advantages are computed over the whole list of groups given (`batch_advantages`):
  `reinforce_pp` normalises over all of them whatever their sizes, counting each sample's
  trained response tokens (none for a masked truncated response) under
  `advantage.normalise_over="tokens"`.
- Per-token rewards (`token_rewards`, an episode's per-turn rewards) travel in the same
  [B, L-1] layout as `response_mask`; only GAE reads them (`miles.trainer.scoring`), the
  group estimators train on the sample's scalar `reward` (its return).
- Episodes (1.4, a sample with a `loss_mask`): the row is the prompt and the whole episode, the
  observation tokens are context, and `response_mask` marks the policy's tokens only, so every
  loss, KL, entropy, importance weight and metric downstream (all of them read this mask) counts
  policy tokens; `trained_tokens` too. Token limits count the whole episode: the overlong
  penalty measures T (policy and observation tokens) against `sampling.max_new_tokens`, the
  limit a producer records for an episode's tokens after the prompt (docs/wire-format.md,
  "Episodes"), as truncation does.
- The overlong penalty needs each group's recorded `sampling.max_new_tokens`: a group without it
  is refused (`shaped_rewards` raises; the trainer's intake dead-letters it first), since
  falling back to the longest response would give that response the full penalty.
"""

from __future__ import annotations

from dataclasses import dataclass
import numpy as np
import torch

from miles.errors import MilesError
from miles.protocol import Sample, TrajectoryGroup
from miles.rl.advantages import batch_advantages
from miles.rl.aggregation import Normalisers
from miles.rl.algorithm import AlgorithmConfig


OVERLONG_NEEDS_LIMIT = ("sampling.max_new_tokens must be recorded (> 0) under the overlong "
                        "penalty (learner.algorithm.overlong_buffer > 0): without it the longest "
                        "response would take the full penalty")
"""Why a group without a recorded response limit is refused under the overlong penalty."""


@dataclass(frozen=True)
class SamplingSetting:
    """The distribution the engine sampled from (`miles.rl.sampling.sampled_logprobs` args)."""

    temperature: float = 1.0
    top_k: int = 0  # 0 (or any value <= 0 on the wire, e.g. vLLM's -1): no top-k filter
    top_p: float = 1.0


@dataclass(frozen=True)
class MicroBatch:
    """One forward/backward worth of rows, all sampled under `sampling`."""

    input_ids: torch.Tensor  # [R, T] int64 model input, right-padded: R = B rows of prompt +
    # response (T = L), or R <= B packed lines of several samples each
    attention_mask: torch.Tensor | None  # [R, T] int64, 1 on real tokens; None when packed;
    # [R, 1, T, T] bool (True: may attend) when a line shares a prompt (`sample_targets`)
    position_ids: torch.Tensor  # [R, T] int64, 0..len-1 on each sample's tokens, 0 on padding
    response_mask: torch.Tensor  # [B, L-1] bool: target t of a sample (its token t+1) is a
    # trained response token (the policy's tokens of a row: an episode's observation tokens
    # are not, none for a masked row)
    behaviour_logprobs: torch.Tensor  # [B, L-1] float32 engine logprobs of the targets, 0 off-mask
    advantages: torch.Tensor  # [B] float32 outcome advantages (0 under the critic: GAE is later)
    rewards: torch.Tensor  # [B] float32 shaped rewards
    sampling: SamplingSetting
    sample_ids: tuple[tuple[str, int], ...]  # [B] (group_id, index in group.samples)
    layout: torch.Tensor | None = None  # packed: [B, L-1] int64 index of each sample's target
    # t among the R x (T-1) predictions, flattened (0 past the sample's end); None: padded
    token_rewards: torch.Tensor | None = None  # [B, L-1] float32 the wire `token_rewards`
    # aligned with `response_mask` (target t: the sample's token t+1), 0 elsewhere (and for a
    # sample without them); None: no sample of the micro-batch has any
    sample_targets: torch.Tensor | None = None  # [B, L-1] int64 each sample's token t+1, when
    # a line shares one prompt among samples (its next token in the line is then not every
    # sample's target); `attention_mask` is then [R, 1, T, T] bool; None: `targets` serve

    @property
    def targets(self) -> torch.Tensor:
        """The token each model position predicts, [R, T-1] (model layout)."""
        return self.input_ids[:, 1:]

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """Per-prediction `values` of the model layout ([R, T-1]) in the per-sample layout
        ([B, L-1]) of `response_mask`; entries past a sample's end are arbitrary."""
        if self.layout is None:
            return values
        return values.reshape(-1)[self.layout.to(values.device)]

    @property
    def num_tokens(self) -> int:
        """Response tokens of the micro-batch (the loss's token count)."""
        return int(self.response_mask.sum())


@dataclass(frozen=True)
class _Row:
    sample_id: tuple[str, int]
    prompt: np.ndarray  # [P]
    sample: Sample
    reward: float  # after shaping
    advantage: float
    trained: bool  # False: the row is scored but has no loss (a masked truncated response)

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.sample.response_token_ids)


def sampling_setting(group: TrajectoryGroup) -> SamplingSetting:
    """The sampling setting recorded with `group`, with the disabled filters normalised."""
    params = group.sampling
    temperature = float(params.get("temperature", 1.0))
    top_p = float(params.get("top_p", 1.0))
    if not temperature > 0 or not 0 < top_p <= 1:
        raise MilesError(f"group {group.group_id}: cannot score tokens sampled with "
                         f"temperature={temperature}, top_p={top_p}")
    return SamplingSetting(temperature=temperature, top_k=max(int(params.get("top_k", 0)), 0),
                           top_p=top_p)


def recorded_max_new_tokens(group: TrajectoryGroup) -> int:
    """The response length limit recorded with `group`; 0 when not recorded."""
    return int(group.sampling.get("max_new_tokens", 0))


def max_new_tokens(group: TrajectoryGroup) -> int:
    """The response length limit `group` was sampled with (its longest response if unrecorded:
    the constant of `seq_sum_constant`)."""
    recorded = recorded_max_new_tokens(group)
    return recorded if recorded > 0 else max(len(s.response_token_ids) for s in group.samples)


def shaped_rewards(group: TrajectoryGroup, algorithm: AlgorithmConfig) -> torch.Tensor:
    """The recorded rewards of `group` ([n]), plus DAPO's overlong penalty when configured:
    0 up to max_new_tokens - overlong_buffer tokens, then falling linearly to -overlong_penalty
    at max_new_tokens. A group without a recorded max_new_tokens is refused (MilesError)."""
    rewards = torch.tensor([s.reward for s in group.samples], dtype=torch.float64)  # [n]
    if algorithm.overlong_buffer:
        limit = recorded_max_new_tokens(group)
        if limit <= 0:
            raise MilesError(f"group {group.group_id}: {OVERLONG_NEEDS_LIMIT}")
        lengths = torch.tensor([len(s.response_token_ids) for s in group.samples])  # [n]
        excess = (lengths - (limit - algorithm.overlong_buffer)).clamp(min=0)
        rewards -= (excess / algorithm.overlong_buffer).clamp(max=1.0) * algorithm.overlong_penalty
    return rewards


def trained_tokens(group: TrajectoryGroup, algorithm: AlgorithmConfig) -> torch.Tensor:
    """Response tokens of each sample of `group` that get a loss ([n]: its policy tokens, 0 for
    a masked truncated response): what `reinforce_pp` counts under normalise_over="tokens"."""
    return torch.tensor([0 if algorithm.mask_truncated and s.finish_reason == "length"
                         else s.policy_tokens for s in group.samples],
                        dtype=torch.float64)


def outcome_advantages(groups: list[TrajectoryGroup], algorithm: AlgorithmConfig
                       ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(shaped rewards, advantages) per group ([n] each) under `algorithm.estimator`, over the
    whole list of groups; zero advantages for `gae`, whose advantages come from the critic."""
    rewards = [shaped_rewards(g, algorithm) for g in groups]
    if algorithm.uses_critic or not groups:
        return rewards, [torch.zeros(len(r)) for r in rewards]
    return rewards, batch_advantages(rewards, estimator=algorithm.estimator,
                                     settings=algorithm.advantage,
                                     weights=[trained_tokens(g, algorithm) for g in groups])


def group_rows(group: TrajectoryGroup, rewards: torch.Tensor, advantages: torch.Tensor, *,
               mask_truncated: bool = False) -> list[_Row]:
    """One row per sample of `group`."""
    return [_Row((group.group_id, i), group.prompt_token_ids, sample, reward, advantage,
                 not (mask_truncated and sample.finish_reason == "length"))
            for i, (sample, reward, advantage)
            in enumerate(zip(group.samples, rewards.tolist(), advantages.tolist(), strict=True))]


def first_fit(rows: list[_Row], width: int) -> list[list[_Row]]:
    """`rows` (longest first) placed into lines of at most `width` tokens, each into the first
    line with room. Only lines with room for the shortest row are searched (in order), so rows
    that fill their lines cost no search."""
    lines: list[list[_Row]] = []
    loads: list[int] = []
    shortest = rows[-1].length if rows else 0
    open_lines: list[int] = []  # lines that can still take the shortest row, in order
    for row in rows:
        into = next((i for i in open_lines if loads[i] + row.length <= width), None)
        if into is None:
            lines.append([])
            loads.append(0)
            into = len(lines) - 1
            open_lines.append(into)
        lines[into].append(row)
        loads[into] += row.length
        if loads[into] + shortest > width:
            open_lines.remove(into)
    return lines


@dataclass(frozen=True)
class _Line:
    """One model row: samples placed one after the other, or (`shared`) one group's samples
    after a single copy of their prompt, each response attending to it and to itself."""

    rows: list[_Row]
    shared: bool = False

    @property
    def length(self) -> int:
        if self.shared:
            return len(self.rows[0].prompt) + sum(len(r.sample.response_token_ids)
                                                  for r in self.rows)
        return sum(row.length for row in self.rows)


def sharing_pays(rows: list[_Row], hidden: int) -> bool:
    """Whether one copy of the prompt of `rows` (one group's samples) costs less compute than a
    copy per sample at model width `hidden`. Per layer, a token's projections cost ~24 h^2 and
    each (query, key) pair of attention ~4 h, and a masked pair costs as much as any: sharing
    saves (k - 1) P tokens and adds T^2 - sum (P + L_i)^2 pairs (T: the shared line's length)."""
    prompt = len(rows[0].prompt)
    shared = prompt + sum(len(r.sample.response_token_ids) for r in rows)
    separate = sum(r.length ** 2 for r in rows)
    return (len(rows) - 1) * prompt * 6 * hidden > shared ** 2 - separate


def shared_lines(rows: list[_Row], max_tokens: int, hidden: int) -> list[_Line]:
    """A shared line for each group among `rows` with two or more samples, where sharing pays
    and the line fits in `max_tokens`."""
    groups: dict[str, list[_Row]] = {}
    for row in rows:
        groups.setdefault(row.sample_id[0], []).append(row)
    lines = [_Line(group, shared=True) for group in groups.values() if len(group) > 1]
    return [line for line in lines
            if line.length <= max_tokens and sharing_pays(line.rows, hidden)]


def pack_rows(rows: list[_Row], max_tokens: int, *, packed: bool = False, share_width: int = 0
              ) -> list[list[_Line]]:
    """`rows` as micro-batches of lines (model rows) of samples, each micro-batch at most
    `max_tokens` = lines x longest line. Padded: one sample per line. Packed: samples first-fit
    into lines as long as the longest sample (or shared line). `share_width` (packed only; the
    model's hidden size, 0: never): a group's samples share a line and one copy of their prompt
    where that saves compute (`sharing_pays`)."""
    rows = sorted(rows, key=lambda r: r.length, reverse=True)
    lines = shared_lines(rows, max_tokens, share_width) if packed and share_width else []
    placed = {row.sample_id for line in lines for row in line.rows}
    rows = [row for row in rows if row.sample_id not in placed]
    if packed and rows:
        width = max([rows[0].length] + [line.length for line in lines])
        lines += [_Line(line) for line in first_fit(rows, width)]
    else:
        lines += [_Line([row]) for row in rows]
    lines.sort(key=lambda line: line.length, reverse=True)
    batches: list[list[_Line]] = []
    for line in lines:  # longest first: batches[-1][0] is the longest line of the last batch
        if batches and (len(batches[-1]) + 1) * batches[-1][0].length <= max_tokens:
            batches[-1].append(line)
        else:
            batches.append([line])
    return batches


def line_layout(line: _Line, r: int, seq: int, length: int, arrays: dict[str, np.ndarray],
                b: int) -> tuple[int, int]:
    """Write `line` into model row `r` of `arrays` (its samples from per-sample row `b`, its
    sequences numbered from `seq`); returns the next (b, seq)."""
    count = arrays["count"]
    offset = 0
    if line.shared:  # the prompt once, a sequence of its own that each response may see
        prompt = line.rows[0].prompt
        arrays["input_ids"][r, :len(prompt)] = prompt
        arrays["position_ids"][r, :len(prompt)] = count[:len(prompt)]
        arrays["seq"][r, :len(prompt)] = seq
        offset, shared_seq, seq = len(prompt), seq, seq + 1
    for row in line.rows:
        p, n, sample = len(row.prompt), row.length, row.sample
        own = n if not line.shared else n - p  # tokens of the row written in the line
        start = offset - (0 if not line.shared else p)  # line position of the row's token 0
        tokens = np.concatenate([row.prompt, sample.response_token_ids])
        arrays["input_ids"][r, offset:offset + own] = tokens[n - own:]
        arrays["position_ids"][r, offset:offset + own] = count[n - own:n]
        arrays["seq"][r, offset:offset + own] = seq
        if line.shared:
            arrays["sees"][r, offset:offset + own] = shared_seq
        positions = start + count[:n - 1]  # the line position predicting target t
        if line.shared:
            positions[:p] = count[:p]
        arrays["layout"][b, :n - 1] = r * (length - 1) + positions
        arrays["targets"][b, :n - 1] = tokens[1:]
        if row.trained:  # targets p..n-1 (predicted at p-1..n-2): the policy's tokens
            arrays["response_mask"][b, p - 1:n - 1] = sample.policy_mask
        arrays["behaviour"][b, p - 1:n - 1] = sample.logprobs
        if sample.token_rewards is not None:
            arrays["steps"][b, p - 1:n - 1] = sample.token_rewards
        offset += own
        b += 1
        seq += 1
    arrays["attention_mask"][r, :offset] = 1
    arrays["position_ids"][r, offset:] = count[:length - offset]  # padding: a sequence of its own
    arrays["seq"][r, offset:] = seq
    return b, seq + 1


def visibility(seq: np.ndarray, sees: np.ndarray) -> torch.Tensor:
    """[R, 1, T, T] bool attention mask (True: may attend) of lines whose tokens belong to
    sequences `seq` ([R, T]): causal within a sequence, and onto the sequence `sees` names (a
    shared prompt; -1: none)."""
    seq, sees = torch.from_numpy(seq), torch.from_numpy(sees)
    causal = torch.ones(seq.shape[1], seq.shape[1], dtype=torch.bool).tril()
    allowed = (seq.unsqueeze(2) == seq.unsqueeze(1)) | (sees.unsqueeze(2) == seq.unsqueeze(1))
    return (allowed & causal).unsqueeze(1)


def collate(lines: list[_Line], sampling: SamplingSetting, *, pad_id: int,
            packed: bool = False) -> MicroBatch:
    """The tensors of `lines` of samples (see the module docstring): each line is one model row,
    right-padded to the longest; a packed line's padding is a sequence of its own. Filled as
    numpy arrays (a slice assignment costs a fraction of a torch one), then wrapped."""
    rows = [row for line in lines for row in line.rows]
    width = max(r.length for r in rows)  # L: the per-sample layout
    length = max(line.length for line in lines)  # T
    shared = any(line.shared for line in lines)
    arrays = {
        "count": np.arange(max(width, length)),
        "response_mask": np.zeros((len(rows), width - 1), dtype=bool),  # [B, L-1]
        "behaviour": np.zeros((len(rows), width - 1), dtype=np.float32),  # [B, L-1]
        "steps": np.zeros((len(rows), width - 1), dtype=np.float32),  # [B, L-1]
        "layout": np.zeros((len(rows), width - 1), dtype=np.int64),  # [B, L-1]
        "targets": np.zeros((len(rows), width - 1), dtype=np.int64),  # [B, L-1]
        "input_ids": np.full((len(lines), length), pad_id, dtype=np.int64),  # [R, T]
        "position_ids": np.zeros((len(lines), length), dtype=np.int64),  # [R, T]
        "attention_mask": np.zeros((len(lines), length), dtype=np.int64),  # [R, T]
        "seq": np.zeros((len(lines), length), dtype=np.int64),  # [R, T] sequence of a token
        "sees": np.full((len(lines), length), -1, dtype=np.int64),  # [R, T] its shared prompt
    }
    b, seq = 0, 0
    for r, line in enumerate(lines):
        b, seq = line_layout(line, r, seq, length, arrays, b)
    if not packed:  # padded: positions are 0 on padding, attention_mask marks it
        arrays["position_ids"] *= arrays["attention_mask"]
    if shared:
        attention_mask = visibility(arrays["seq"], arrays["sees"])
    else:
        attention_mask = None if packed else torch.from_numpy(arrays["attention_mask"])
    return MicroBatch(
        input_ids=torch.from_numpy(arrays["input_ids"]), attention_mask=attention_mask,
        position_ids=torch.from_numpy(arrays["position_ids"]),
        response_mask=torch.from_numpy(arrays["response_mask"]),
        behaviour_logprobs=torch.from_numpy(arrays["behaviour"]),
        advantages=torch.tensor([r.advantage for r in rows], dtype=torch.float32),
        rewards=torch.tensor([r.reward for r in rows], dtype=torch.float32),
        sampling=sampling, sample_ids=tuple(r.sample_id for r in rows),
        layout=torch.from_numpy(arrays["layout"]) if packed else None,
        token_rewards=torch.from_numpy(arrays["steps"])
        if any(r.sample.token_rewards is not None for r in rows) else None,
        sample_targets=torch.from_numpy(arrays["targets"]) if shared else None)


def make_micro_batches(groups: list[TrajectoryGroup], *, max_tokens: int, pad_id: int = 0,
                       algorithm: AlgorithmConfig = AlgorithmConfig(),
                       outcomes: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None,
                       packed: bool = False, skip_inert: bool = False,
                       share_width: int = 0) -> list[MicroBatch]:
    """Micro-batches holding every sample of `groups` exactly once, padded or `packed`.
    `outcomes`: the (rewards, advantages) of `groups` when computed over a larger batch
    (default: over `groups`). `skip_inert`: leave out the samples that cannot move the gradient
    of an `advantage_only` algorithm (advantage 0, or no trained token); the caller counts
    them in the normalisers (`loss_normalisers`). `share_width`: see `pack_rows`."""
    if max_tokens < 1:
        raise MilesError(f"max_tokens must be >= 1, got {max_tokens}")
    for group in groups:
        if len(group.prompt_token_ids) < 1:
            raise MilesError(f"group {group.group_id}: empty prompt (nothing predicts the "
                             "first response token)")
    rewards, advantages = outcomes or outcome_advantages(groups, algorithm)
    by_setting: dict[SamplingSetting, list[_Row]] = {}
    for group, r, a in zip(groups, rewards, advantages, strict=True):
        rows = group_rows(group, r, a, mask_truncated=algorithm.mask_truncated)
        if skip_inert:
            rows = [row for row in rows if row.trained and row.advantage != 0.0]
        if rows:
            by_setting.setdefault(sampling_setting(group), []).extend(rows)
    return [collate(lines, setting, pad_id=pad_id, packed=packed)
            for setting, rows in by_setting.items()
            for lines in pack_rows(rows, max_tokens, packed=packed, share_width=share_width)]


def loss_normalisers(groups: list[TrajectoryGroup], algorithm: AlgorithmConfig) -> Normalisers:
    """The loss's denominators over all samples of `groups` (whether or not a sample gets a
    forward): trained tokens, rows with a trained token, and the longest recorded response
    limit (`max_new_tokens`)."""
    counts = torch.cat([trained_tokens(g, algorithm) for g in groups])  # [samples]
    return Normalisers(tokens=float(counts.sum()), rows=float((counts > 0).sum()),
                       constant=float(max(max_new_tokens(g) for g in groups)))


def idle_micro_batch(*, pad_id: int = 0) -> MicroBatch:
    """A micro-batch with no response token: a rank with less data runs it so every rank does
    the same number of forward/backward passes (FSDP collectives must match)."""
    return MicroBatch(
        input_ids=torch.full((1, 2), pad_id, dtype=torch.int64),
        attention_mask=torch.ones((1, 2), dtype=torch.int64),  # all real: no fully masked row
        position_ids=torch.arange(2).unsqueeze(0), response_mask=torch.zeros((1, 1), dtype=bool),
        behaviour_logprobs=torch.zeros((1, 1)), advantages=torch.zeros(1), rewards=torch.zeros(1),
        sampling=SamplingSetting(), sample_ids=())
