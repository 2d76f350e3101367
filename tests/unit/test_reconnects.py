"""aiokafka's reconnect logging cut to one line per outage, a periodic summary and an end line."""

import logging

from miles.bus.reconnects import QUIET_S, SUMMARY_S, ReconnectLogFilter


class Clock:
    now = 0.0

    def __call__(self):
        return self.now


def test_one_line_per_outage_then_a_summary(caplog):
    clock = Clock()
    logger = logging.getLogger("aiokafka.client.test_reconnects")
    logger.addFilter(ReconnectLogFilter(clock))
    caplog.set_level(logging.INFO, logger=logger.name)
    messages = lambda: [r.getMessage() for r in caplog.records]  # noqa: E731
    try:
        for _ in range(int(SUMMARY_S * 10) + 100):  # 70 s of attempts, aiokafka's templates
            logger.error('Unable connect to "%s:%s": %s', "127.0.0.1", 9092, OSError("refused"))
            logger.error("Unable connect to node with id %s: %s", 1, OSError("refused"))
            clock.now += 0.1
        assert len(messages()) == 4  # the first of each target, then one summary of each
        assert messages()[0] == 'Unable connect to "127.0.0.1:9092": refused'
        assert "still failing after 60s; 599 repeats suppressed" in messages()[2]
        clock.now += QUIET_S  # the outage ended; the next client line says how it went
        logger.info("something else")
        assert messages()[4:] == [
            "connection failures to 127.0.0.1 9092 ended after 70s; 99 repeats suppressed",
            "connection failures to 1 ended after 70s; 99 repeats suppressed", "something else"]
        logger.error('Unable connect to "%s:%s": %s', "127.0.0.1", 9092, OSError("refused"))
        assert messages()[-1].startswith("Unable connect to")  # a new outage: its first line
    finally:
        logger.filters.clear()
