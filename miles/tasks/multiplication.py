"""A built-in multi-turn task where the tool matters: multiplication with a calculator.

Problems are `a*b=` for every pair of `digits`-digit operands (two digits by default: 8100
pairs), split like the addition task (a fixed, seeded shuffle puts `held_out` in the test split);
the reference is the product in the usual digit order. A tiny model cannot multiply two-digit
numbers in its head, but it can copy: the episode the `calculator` environment rewards is

    12*34=<tool>calculator: 12*34</tool>       the model: copy the operands into a call
    <result>408</result>                       the environment (the calculator's answer)
    408</s>                                    the model: copy the result, then EOS

so a policy that uses the tool can reach 100% while the best single-turn policy guesses four
digits. The call is in the compact text style (`miles.envs.tools`), whose stop string `</tool>`
ends the first turn; the observation is appended as text (no chat template), so the model needs
the tag characters of the chat tokenizer (`build_tiny_model(chat=True)`) and about 64 positions.

Warm start (`warm_start_problems`): each problem gives two supervised pairs in the shape
`miles.sft` trains (cross-entropy on the answer and EOS only): the prompt -> the call, and the
prompt + call + result -> the product. Their concatenation is exactly the rewarded episode's
tokens, so SFT teaches the format the environment and the producer's token-in/token-out context
will show the model (tested against the runner).
"""

from __future__ import annotations

import random

from miles.tasks.arithmetic import Problem

DEFAULT_DIGITS = 2
DEFAULT_HELD_OUT = 500
CALL = "<tool>calculator: {a}*{b}</tool>"
RESULT = "<result>{product}</result>"  # what CalculatorEnv's text-style observation looks like


def multiplication_problems(split: str, *, digits: int = DEFAULT_DIGITS,
                            held_out: int = DEFAULT_HELD_OUT, seed: int = 0) -> list[Problem]:
    """The `train` or `test` split of `digits`-by-`digits` multiplication."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if digits < 1:
        raise ValueError(f"digits must be >= 1, got {digits}")
    numbers = range(10 ** (digits - 1) if digits > 1 else 0, 10 ** digits)
    pairs = [(a, b) for a in numbers for b in numbers]
    if not 0 < held_out < len(pairs):
        raise ValueError(f"held_out must be in (0, {len(pairs)}), got {held_out}")
    random.Random(seed).shuffle(pairs)
    chosen = pairs[:held_out] if split == "test" else pairs[held_out:]
    return [Problem(task_id=f"mul-{a}-{b}", prompt=f"{a}*{b}=", answer=str(a * b))
            for a, b in chosen]


def tool_call(problem: Problem) -> str:
    """The first turn a tool-using policy says: the calculator call on the prompt's operands."""
    a, b = problem.prompt.removesuffix("=").split("*")
    return CALL.format(a=a, b=b)


def warm_start_problems(problems: list[Problem]) -> list[Problem]:
    """Two supervised pairs per problem (see the module docstring), for `miles.sft`."""
    out = []
    for p in problems:
        call = tool_call(p)
        out.append(Problem(task_id=f"{p.task_id}/call", prompt=p.prompt, answer=call))
        out.append(Problem(task_id=f"{p.task_id}/answer",
                           prompt=p.prompt + call + RESULT.format(product=p.answer),
                           answer=p.answer))
    return out
