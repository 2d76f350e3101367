"""The trainer's one-line live progress display.

On a terminal the line is rewritten in place each step; elsewhere (logs, CI) each step is one
INFO log line. Only a handful of headline numbers: the full record is in metrics.jsonl.
"""

from __future__ import annotations

import logging
import sys

log = logging.getLogger("miles.progress")

FIELDS = (("step", "step", "{:.0f}"), ("trainer/policy_version", "v", "{:.0f}"),
          ("trainer/reward_mean", "reward", "{:.3f}"), ("trainer/loss", "loss", "{:+.4f}"),
          ("trainer/kl_behaviour", "kl", "{:.2e}"), ("trainer/max_lag", "lag", "{:.0f}"),
          ("trainer/dropped_stale", "stale", "{:.0f}"), ("trainer/step_s", "s/step", "{:.2f}"))


def progress_line(metrics: dict) -> str:
    parts = [f"{label} {fmt.format(metrics[key])}" for key, label, fmt in FIELDS
             if isinstance(metrics.get(key), (int, float))]
    return " | ".join(parts)


class Progress:
    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.live = self.stream.isatty()
        self._drawn = False

    def update(self, metrics: dict) -> None:
        line = progress_line(metrics)
        if self.live:
            self.stream.write("\r\x1b[2K" + line)
            self.stream.flush()
            self._drawn = True
        else:
            log.info(line)

    def close(self) -> None:
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False
