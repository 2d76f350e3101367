"""`Trackers`: calls in order on its worker thread, numbers only, errors raised to the caller,
every tracker closed (stand-in trackers: the libraries are tested in
tests/integration/test_trackers.py)."""

from __future__ import annotations

import threading

import pytest

from miles.errors import MilesError
from miles.trackers import TrackerSettings, Trackers, markdown_table


class Recording:
    def __init__(self, fail_on: str = ""):
        self.calls, self.threads, self.fail_on = [], set(), fail_on

    def _record(self, *call):
        self.threads.add(threading.current_thread().name)
        self.calls.append(call)
        if call[0] == self.fail_on:
            raise RuntimeError(f"{self.fail_on} failed")

    def log(self, metrics, step):
        self._record("log", metrics, step)

    def table(self, rows, step):
        self._record("table", len(rows), step)

    def close(self):
        self._record("close")


def test_calls_reach_every_tracker_in_order_off_the_callers_thread():
    first, second = Recording(), Recording()
    with Trackers(TrackerSettings(), [first, second]) as trackers:
        trackers.log({"trainer/loss": 0.5, "histogram": {"0": 3}, "paused": True, "n": 2}, 1)
        trackers.log_samples([{"a": 1}, {"a": 2}], 1)
        trackers.log_samples([], 2)  # an empty table is not sent
    expected = [("log", {"trainer/loss": 0.5, "n": 2.0}, 1), ("table", 2, 1), ("close",)]
    assert first.calls == second.calls == expected
    assert threading.current_thread().name not in first.threads | second.threads


def test_a_failing_tracker_raises_at_the_next_call_and_every_tracker_is_closed():
    failing, other = Recording(fail_on="log"), Recording()
    trackers = Trackers(TrackerSettings(), [failing, other])
    trackers.log({"x": 1.0}, 1)
    with pytest.raises(MilesError, match="trackers: RuntimeError: log failed"):
        trackers.close()
    assert failing.calls[-1] == ("close",) and other.calls[-1] == ("close",)


def test_no_trackers_do_nothing():
    trackers = Trackers()
    trackers.log({"x": 1.0}, 1)
    trackers.close()
    assert not trackers.samples_due(1)


@pytest.mark.parametrize("every, due", [(1, [1, 2, 3, 4]), (2, [2, 4]), (3, [3])])
def test_samples_every(every, due):
    trackers = Trackers(TrackerSettings(samples_every=every))
    assert [s for s in range(1, 5) if trackers.samples_due(s)] == due


def test_markdown_table_escapes_what_would_break_a_row():
    text = markdown_table([{"prompt": "a|b", "completion": "x\ny"}])
    assert text.splitlines() == ["| prompt | completion |", "|---|---|", "| a\\|b | x<br>y |"]
