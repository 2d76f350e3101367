"""Rewards for tests, importable as `tests.rewards:NAME` by producer processes."""


def starts_with_digit(response: str, reference: str | None) -> float:
    """A reward an untrained model earns sometimes, so advantages are not all zero."""
    return float(response[:1].isdigit())


def digit_for_odd_answers(response: str, reference: str | None) -> float:
    """0 whenever the reference answer is even (such groups have equal rewards by design),
    `starts_with_digit` otherwise."""
    odd = bool(reference) and reference[-1] in "13579"
    return starts_with_digit(response, reference) if odd else 0.0
