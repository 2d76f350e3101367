"""One log line per broker outage instead of one per reconnect attempt.

aiokafka logs every failed connection attempt at ERROR (client.py, on the `aiokafka` logger: 'Unable connect to
"host:port": ...', "Unable connect to node with id N: ...", "Unable to update metadata from
[...]"), which during a broker outage is tens of thousands of lines per process. The
`ReconnectLogFilter` that `miles.bus.kafka` installs on that logger lets the first such line of a
target (the host, node or node list) through, suppresses the repeats, and lets one through every
`SUMMARY_S` with how many were suppressed. When an attempt of a target is the first after
`QUIET_S` without failures (the outage ended and a new one began), or any other aiokafka client
line passes, the count of the ended outage is logged first ("... N repeats suppressed").

Simplification: the end of an outage is noticed from the log itself (aiokafka logs no success
line at INFO), so the summary of the last outage appears with the next aiokafka client line.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

LOGGER = "aiokafka"  # aiokafka/client.py logs on "aiokafka", not on its module name
FAILURES = ("Unable connect to", "Unable to update metadata from")  # aiokafka's own templates
SUMMARY_S = 60.0  # during an outage, one line per target per this many seconds
QUIET_S = 10.0  # no failure of a target for this long: its outage has ended


@dataclass
class _Outage:
    started: float
    last_seen: float
    last_logged: float
    suppressed: int = 0


class ReconnectLogFilter(logging.Filter):
    def __init__(self, clock=time.monotonic):
        super().__init__()
        self.clock = clock
        self.outages: dict[tuple, _Outage] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        now = self.clock()
        self._report_ended(now, logging.getLogger(record.name))
        if not isinstance(record.msg, str) or not record.msg.startswith(FAILURES):
            return True
        args = record.args if isinstance(record.args, tuple) else ()
        key = (record.msg, *map(str, args[:-1] if "connect" in record.msg else args))
        outage = self.outages.get(key)
        if outage is None:
            self.outages[key] = _Outage(started=now, last_seen=now, last_logged=now)
            return True
        outage.last_seen = now
        if now - outage.last_logged < SUMMARY_S:
            outage.suppressed += 1
            return False
        record.msg += f" (still failing after {now - outage.started:.0f}s; " \
                      f"{outage.suppressed} repeats suppressed)"
        outage.suppressed, outage.last_logged = 0, now
        return True

    def _report_ended(self, now: float, logger: logging.Logger) -> None:
        ended = [(k, o) for k, o in self.outages.items() if now - o.last_seen >= QUIET_S]
        for key, _ in ended:
            del self.outages[key]
        for key, outage in ended:
            if outage.suppressed:
                # a new record, not the one being filtered: it passes this filter (no FAILURES)
                logger.warning("connection failures to %s ended after %.0fs; %d repeats "
                               "suppressed", " ".join(key[1:]) or key[0],
                               outage.last_seen - outage.started, outage.suppressed)


def install(logger_name: str = LOGGER) -> ReconnectLogFilter:
    """Install the filter on `logger_name` once (idempotent); returns the installed filter."""
    logger = logging.getLogger(logger_name)
    for existing in logger.filters:
        if isinstance(existing, ReconnectLogFilter):
            return existing
    installed = ReconnectLogFilter()
    logger.addFilter(installed)
    return installed
