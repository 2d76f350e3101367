"""Rewards: the math verifier, the format check, plugins of every shape through the `Scorer`
(timeouts and failures mark samples, never raise), the `rm:` reward model, and the producer
scoring a group with one call."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from miles.engines.base import Completion
from miles.errors import ConfigError
from miles.rollout import RolloutConfig, RolloutWorker
from miles.tasks.rewards import Scored, Scorer, batched, exact_match, resolve_reward
from miles.tasks.rewards.answers import extract_answer, math_answer
from tests.factories import make_prompt_task

REPO = Path(__file__).resolve().parents[2]


# --- math: extraction and equivalence ---------------------------------------------------------

@pytest.mark.parametrize("text, answer", [
    (r"so the total is \boxed{42}.", "42"),
    (r"\boxed{1} first, then \boxed{\frac{1}{2}}", r"\frac{1}{2}"),  # the last box, nested braces
    (r"\boxed{x^{2}+1}", "x^{2}+1"),
    (r"\boxed{3} then \boxed{x + 4", "4"),  # the last box is unclosed: the last number
    ("The answer is 42 apples.", "42"),
    ("answer is 3, no wait, the answer is: -7.", "-7"),
    ("Answer: \\dfrac12 obviously", "\\dfrac12"),
    ("Final answer: B.", "B."),
    ("steps...\n#### 1,000", "1,000"),
    ("3 + 4 = 7, then 7 * 2 = 14", "14"),  # no marker: the last number
    ("10-5", "5"),  # a minus between digits is not a sign
    ("it is -5", "-5"),
    ("about .5 of it", ".5"),
    ("half is 1/2", "1/2"),
    ("no digits here", None),
])
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


@pytest.mark.parametrize("response, reference, reward", [
    ("42", "42", 1.0),
    ("0.50", "0.5", 1.0),
    (".5", "0.5", 1.0),
    (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"\boxed{\dfrac12}", "1/2", 1.0),
    (r"\boxed{-\tfrac{3}{4}}", "-0.75", 1.0),
    ("The answer is 1,000.", "1000", 1.0),
    (r"\boxed{1{,}000}", "1000", 1.0),
    ("Answer: +3", "3", 1.0),
    ("the answer is $5$.", "5", 1.0),
    (r"\boxed{x = 5}", "5", 1.0),
    ("so 3 + 4 = 7", "7.0", 1.0),
    ("the answer is B", "B", 1.0),
    (r"\boxed{\text{B}}", "B", 1.0),
    (r"\boxed{2 \sqrt{2}}", r"2\sqrt{2}", 1.0),  # equal as normalised strings
    ("the answer is x", r"the solution is \boxed{x}", 1.0),  # a boxed reference is extracted too
    ("12", "1/2", 0.0),
    (r"\boxed{\frac{1}{2}}", "12", 0.0),
    ("0.5", "5", 0.0),
    ("1,000", "1", 0.0),
    ("100", "1,000", 0.0),
    ("-3", "3", 0.0),
    ("the answer is b", "B", 0.0),  # strings keep their case
    ("1/0", "0", 0.0),  # not a number, and not the string "0"
    ("9" * 5000, "9", 0.0),  # too long for int(): not a number, no crash
    ("no answer", "7", 0.0),
])
def test_math_answer(response, reference, reward):
    assert math_answer(response, reference) == reward


def test_math_answer_needs_a_reference():
    with pytest.raises(ValueError, match="reference"):
        math_answer("1", None)


# --- format ----------------------------------------------------------------------------------

@pytest.mark.parametrize("response, reward", [
    ("<think>7 = 3 + 4\nso</think> <answer>7</answer>", 1.0),
    ("  <think></think><answer>7</answer>\n", 1.0),
    ("<think>a</think><answer> </answer>", 0.0),  # empty answer
    ("<answer>7</answer>", 0.0),  # no reasoning
    ("<think>a</think><answer>7</answer> and more", 0.0),  # text after the answer
    ("7", 0.0),
])
async def test_default_format(response, reward):
    (scored,) = await resolve_reward("format").score([response], [None], [""])
    assert scored == Scored(reward)


async def test_format_with_a_pattern():
    scorer = resolve_reward(r"format:.*\\boxed\{.+\}.*")
    scored = await scorer.score([r"so \boxed{3}.", r"\boxed{}", "3"], [None] * 3, [""] * 3)
    assert [s.reward for s in scored] == [1.0, 0.0, 0.0]


# --- resolving specs -------------------------------------------------------------------------

def test_resolve_builtins_and_plugins():
    assert resolve_reward("exact_match").fn is exact_match
    assert resolve_reward("math").fn is math_answer
    assert resolve_reward("miles.tasks.rewards:exact_match").fn is exact_match
    plugin = resolve_reward("tests.rewards:async_length", timeout_s=2.5)
    assert (plugin.is_async, plugin.batched, plugin.takes_prompt, plugin.timeout_s) == \
        (True, False, True, 2.5)
    batch = resolve_reward("tests.rewards:batched_match")
    assert (batch.is_async, batch.batched, batch.takes_prompt) == (False, True, False)
    assert resolve_reward("tests.rewards:async_batched_prompts").takes_prompt
    assert not resolve_reward("tests.rewards:starts_with_digit").takes_prompt


@pytest.mark.parametrize("spec, message", [
    ("nope", "must be one of .*exact_match"),
    (":f", "must be one of"),
    ("tests.rewards:", "must be one of"),
    ("no.such.module:f", "module 'no.such.module' cannot be imported: ModuleNotFoundError"),
    ("tests.rewards:missing", "has no attribute 'missing'"),
    ("tests.rewards:NOT_CALLABLE", "is not callable"),
    ("format:(", "not a regular expression"),
    ("rm:/no/such/reward/model", "cannot load a sequence-classification model"),
])
def test_resolve_errors(spec, message):
    with pytest.raises(ConfigError, match=message):
        resolve_reward(spec)


@pytest.mark.parametrize("timeout_s", [0, -1, float("inf"), float("nan")])
def test_timeout_must_be_positive_and_finite(timeout_s):
    with pytest.raises(ConfigError, match="reward_timeout_s"):
        resolve_reward("exact_match", timeout_s=timeout_s)


# --- the scorer: shapes, timeouts, failures --------------------------------------------------

async def test_sync_reward_per_sample():
    scored = await resolve_reward("exact_match").score([" 85", "58"], ["85", "85"], ["", ""])
    assert scored == [Scored(1.0), Scored(0.0)]
    assert await resolve_reward("exact_match").score([], [], []) == []


async def test_async_reward_gets_the_prompt():
    scorer = resolve_reward("tests.rewards:async_length")
    scored = await scorer.score(["xy", "z"], [None, None], ["abc", ""])
    assert scored == [Scored(5.0), Scored(1.0)]


async def test_batched_rewards_are_called_once_per_score():
    calls = []

    @batched
    def count(responses, references):
        calls.append(len(responses))
        return [float(len(r)) for r in responses]

    scored = await Scorer(count).score(["a", "bb", "ccc"], [None] * 3, [""] * 3)
    assert [s.reward for s in scored] == [1.0, 2.0, 3.0] and calls == [3]


async def test_batched_reward_results_are_checked():
    scorer = resolve_reward("tests.rewards:batched_match")
    assert await scorer.score(["1", "2"], ["1", "3"], ["", ""]) == [Scored(1.0), Scored(0.0)]
    short = await scorer.score(["1", "2", "3"], ["1", "short", "3"], [""] * 3)
    assert short == [Scored(0.0, "reward returned 2 values for 3 responses")] * 3
    prompts = resolve_reward("tests.rewards:async_batched_prompts")
    scored = await prompts.score(["x", "nan", "y"], [None] * 3, ["c", "a", "b"])
    assert scored == [Scored(2.0), Scored(0.0, "reward is not finite: nan"), Scored(1.0)]


async def test_failures_mark_their_sample_and_never_raise():
    scorer = resolve_reward("tests.rewards:failing")
    scored = await scorer.score(["boom", "inf", "none", "fine"], [None] * 4, [""] * 4)
    assert scored[0] == Scored(0.0, "reward failed: KeyError: 'boom'")
    assert scored[1] == Scored(0.0, "reward is not finite: inf")
    assert scored[2].reward == 0.0 and scored[2].error.startswith("reward failed: TypeError")
    assert scored[3] == Scored(0.5)


async def test_a_batched_reward_that_raises_marks_every_sample():
    @batched
    async def broken(responses, references):
        raise RuntimeError("service down")

    scored = await Scorer(broken).score(["a", "b"], [None, None], ["", ""])
    assert scored == [Scored(0.0, "reward failed: RuntimeError: service down")] * 2


async def test_a_timeout_raised_by_the_reward_is_a_failure_not_a_timeout():
    async def gives_up(response, reference):
        raise TimeoutError("upstream")

    (scored,) = await Scorer(gives_up, timeout_s=5).score(["a"], [None], [""])
    assert scored == Scored(0.0, "reward failed: TimeoutError: upstream")


@pytest.mark.parametrize("spec", ["tests.rewards:slow", "tests.rewards:async_length"])
async def test_timeouts_mark_the_sample_and_return_quickly(spec):
    stuck = "slow" if spec.endswith("slow") else "hang"
    scorer = resolve_reward(spec, timeout_s=0.2)
    began = time.monotonic()
    scored = await scorer.score(["ok", stuck, "ok"], [None] * 3, ["p"] * 3)
    assert time.monotonic() - began < 2.0
    assert scored[1] == Scored(0.0, "reward timed out after 0.2 s")
    assert scored[0].error is None and scored[2].error is None


async def test_sync_per_sample_calls_overlap():
    def sleepy(response, reference):
        time.sleep(0.5)
        return 1.0

    began = time.monotonic()
    scored = await Scorer(sleepy).score(["a"] * 4, [None] * 4, [""] * 4)
    assert [s.reward for s in scored] == [1.0] * 4
    assert time.monotonic() - began < 1.5, "four 0.5 s calls ran one after another"


def test_a_timed_out_sync_reward_does_not_hold_up_exit():
    code = ("import asyncio; from miles.tasks.rewards import resolve_reward; "
            "s = resolve_reward('tests.rewards:slow', timeout_s=0.1); "
            "print(asyncio.run(s.score(['slow'], [None], [''])))")
    began = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=25, check=True)
    assert "timed out" in out.stdout and time.monotonic() - began < 20  # the reward sleeps 30 s


# --- rm: a sequence-classification checkpoint ------------------------------------------------

def build_reward_model(out_dir: Path, *, num_labels: int, with_pad: bool) -> Path:
    """A tiny Llama sequence classifier and the project's character tokenizer in `out_dir`;
    without `with_pad` neither the tokenizer nor the config has a pad token."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from miles.tasks.tiny_model import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2,
                         vocab_size=len(tokenizer), max_position_embeddings=64,
                         num_labels=num_labels, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id if with_pad else None)
    torch.manual_seed(num_labels)
    LlamaForSequenceClassification(config).save_pretrained(out_dir)
    if not with_pad:
        tokenizer.pad_token = None
    tokenizer.save_pretrained(out_dir)
    return out_dir


def direct_scores(path: Path, texts: list[str], column: int) -> torch.Tensor:
    """One unpadded forward per text, straight through transformers."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        return torch.stack([model(**tokenizer(t, return_tensors="pt")).logits[0, column]
                            for t in texts])


@pytest.mark.parametrize("num_labels, with_pad", [(1, True), (2, False)])
async def test_reward_model_scores_prompt_plus_response(tmp_path, num_labels, with_pad):
    path = build_reward_model(tmp_path / "rm", num_labels=num_labels, with_pad=with_pad)
    prompts = ["12+7=", "3+4=", "100+250=", "1+1="]
    responses = ["19", "seven, I think", "350", ""]  # different lengths: the batch is padded
    expected = direct_scores(path, [p + r for p, r in zip(prompts, responses)],
                             column=0 if num_labels == 1 else -1)
    scorer = resolve_reward(f"rm:{path}", timeout_s=60)
    assert scorer.batched and scorer.takes_prompt
    scored = await scorer.score(responses, [None] * 4, prompts)
    assert all(s.error is None for s in scored)
    assert_close(torch.tensor([s.reward for s in scored]), expected, rtol=1e-5, atol=1e-5)
    one_at_a_time = [(await scorer.score([r], [None], [p]))[0].reward
                     for p, r in zip(prompts, responses)]
    assert_close(torch.tensor(one_at_a_time), expected, rtol=1e-5, atol=1e-5)
    assert len(set(one_at_a_time)) == 4, "a test that cannot fail: the scores should differ"


# --- the producer scores a group with one call -----------------------------------------------

async def test_the_producer_scores_a_group_with_one_call_and_records_errors():
    calls = []

    @batched
    def by_text(responses, references, prompts):
        calls.append((list(responses), list(references), list(prompts)))
        return [{"ab": 1.0, "ba": float("nan")}.get(r, 0.25) for r in responses]

    engine = SimpleNamespace(decode=lambda ids: "".join("abc"[i] for i in ids), name="fake",
                             vocab_size=3, context_limit=None)
    worker = RolloutWorker(None, engine, Scorer(by_text), RolloutConfig())
    try:
        completions = [Completion(token_ids=np.array(ids, dtype=np.int32),
                                  logprobs=np.zeros(len(ids), dtype=np.float32),
                                  finish_reason=finish, policy_version=2)
                       for ids, finish in (([0, 1, 2], "stop"), ([1, 0], "length"),
                                           ([2, 2, 2], "stop"))]
        task = make_prompt_task(prompt="P", reference="ab")
        worker.groups.generate_s = 1.0  # the batch's engine time
        group = await worker.groups.scored_group(task, [5, 6], completions, sequence=1)
    finally:
        worker._executor.shutdown()
    assert calls == [(["ab", "ba", "cc"], ["ab"] * 3, ["P"] * 3)], "cut at EOS, one call"
    assert [s.reward for s in group.samples] == [1.0, 0.0, 0.25]
    assert [s.error for s in group.samples] == [None, "reward is not finite: nan", None]
    assert group.timings["generate_s"] == 1.0 and group.timings["reward_s"] >= 0


async def test_inline_rewards_run_on_the_loop_and_still_never_raise():
    from miles.tasks.rewards import inline, resolve_reward

    assert resolve_reward("exact_match").inline and resolve_reward("math").inline
    assert not resolve_reward("format").inline

    @inline
    def picky(response, reference):
        if response == "boom":
            raise RuntimeError("bad input")
        return float("nan") if response == "nan" else 1.0

    got = await Scorer(picky).score(["ok", "boom", "nan"], [None] * 3, [""] * 3)
    assert got[0] == Scored(1.0)
    assert got[1].reward == 0.0 and got[1].error == "reward failed: RuntimeError: bad input"
    assert got[2].error == "reward is not finite: nan"
