"""Stop strings in the Hugging Face engine: a response ends right after the token that completes
one (kept, finish reason "stop_string"), rows stop independently, EOS and the budget keep their
meaning, and a request without stop strings is unchanged."""

from __future__ import annotations

import numpy as np
import pytest

from miles.engines import HFEngine
from miles.errors import EngineError
from miles.rl.sampling import SamplingParams

PROMPTS = ["37+48=", "1+2=", "123+456=", "9="]
PARAMS = SamplingParams(n=4, temperature=1.0, max_new_tokens=24)


@pytest.fixture(scope="module")
def engine(model_dir):
    return HFEngine(model_dir)


@pytest.fixture(scope="module")
def prompts(engine):
    return [engine.encode(text) for text in PROMPTS]


def first_hit(engine, ids: np.ndarray, stops: tuple[str, ...]) -> int | None:
    """The shortest prefix of `ids` whose text contains a stop string (decoding every prefix:
    the reference the engine's tail-only check must agree with), or None."""
    for k in range(1, len(ids) + 1):
        if any(s in engine.decode(ids[:k]) for s in stops):
            return k
    return None


def pick_stops(engine, groups) -> tuple[str, ...]:
    """Two-character strings from the middle of some unstopped responses, so some rows hit
    them part-way and others (probably) do not."""
    texts = [engine.decode(c.token_ids) for group in groups for c in group]
    picks = [t[5:7] for t in texts[::5] if len(t) >= 8]
    assert picks, texts
    return tuple(dict.fromkeys(picks))


def test_a_stop_string_ends_each_row_after_the_token_that_completes_it(engine, prompts):
    free = engine.generate(prompts, PARAMS, seed=3)
    stops = pick_stops(engine, free)
    stopped = engine.generate(prompts, PARAMS, seed=3, stop_strings=stops)
    hits = 0
    for free_group, group in zip(free, stopped, strict=True):
        for before, after in zip(free_group, group, strict=True):
            k = first_hit(engine, before.token_ids, stops)
            if k is None:  # never reached: the same response as without stop strings
                np.testing.assert_array_equal(after.token_ids, before.token_ids)
                assert after.finish_reason == before.finish_reason
                continue
            hits += 1
            # the same random stream: the stopped row is the free row's prefix up to the hit
            np.testing.assert_array_equal(after.token_ids, before.token_ids[:k])
            np.testing.assert_array_equal(after.logprobs, before.logprobs[:k])
            assert after.finish_reason == "stop_string"
            assert any(engine.decode(after.token_ids).endswith(s[-1]) for s in stops)
    assert hits >= 3  # the picks come from these very rows


def test_eos_wins_and_the_budget_boundary_is_a_stop_string(engine, prompts):
    greedy = SamplingParams(n=1, top_k=1, max_new_tokens=12)
    (free,) = engine.generate(prompts[:1], greedy)[0]
    text = engine.decode(free.token_ids)
    stop = text[4:6]
    k = first_hit(engine, free.token_ids, (stop,))
    assert k is not None and k <= 6
    at_budget = SamplingParams(n=1, top_k=1, max_new_tokens=k)
    (last,) = engine.generate(prompts[:1], at_budget, stop_strings=(stop,))[0]
    assert last.finish_reason == "stop_string" and len(last.token_ids) == k
    (short,) = engine.generate(prompts[:1], SamplingParams(n=1, top_k=1, max_new_tokens=k - 1),
                               stop_strings=(stop,))[0]
    assert short.finish_reason == "length" and len(short.token_ids) == k - 1
    # a stop string the response never reaches changes nothing
    (same,) = engine.generate(prompts[:1], greedy, stop_strings=("ZZZZZZZZ",))[0]
    np.testing.assert_array_equal(same.token_ids, free.token_ids)
    assert same.finish_reason == free.finish_reason


def test_bad_stop_strings_are_refused(engine, prompts):
    for bad in ("</tool>", ("",), (3,), tuple(f"s{i}" for i in range(17))):
        with pytest.raises(EngineError, match="stop strings|stop_strings"):
            engine.generate(prompts[:1], PARAMS, stop_strings=bad)
