"""Kafka bus throughput with TLS + SCRAM against plaintext, on the same machine, in one session.

Run by hand (not a test), from the repository root:

    python benchmarks/bench_bus_security.py [--sizes 65536,1048576] [--megabytes 64]
        [--repeats 3]

Starts two local brokers side by side (`miles broker start` and `miles broker start --secure`:
SASL_SSL, SCRAM-SHA-512, the admin user, so ACL checks run but always pass) and measures
`miles publish` and `miles consume` of `benchmarks/bench_bus.py` on each, taking turns within
each round. The secured client is configured as a user would configure it, through the
`MILES_KAFKA__*` variables. The table shows each row's median round and the ratio
secured / plaintext of the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_bus import MB, consume, create_topic, make_payloads, publish  # noqa: E402
from miles import broker, broker_security  # noqa: E402

MODES = ("plaintext", "TLS+SCRAM")


@contextlib.contextmanager
def secured_env(data_dir: Path | None):
    """The `MILES_KAFKA__*` variables of the secured broker's admin (none for plaintext)."""
    saved = dict(os.environ)
    if data_dir is not None:
        security = broker_security.client_security(data_dir)
        os.environ.update({"MILES_KAFKA__SECURITY_PROTOCOL": "SASL_SSL",
                           "MILES_KAFKA__SASL_USERNAME": security.sasl_username,
                           "MILES_KAFKA__SASL_PASSWORD_FILE": str(security.sasl_password_file),
                           "MILES_KAFKA__SSL_CAFILE": str(security.ssl_cafile)})
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def one_round(bootstrap: str, data_dir: Path | None, size: int, n: int,
              payloads: list[bytes]) -> tuple[float, float]:
    """(publish MB/s, consume MB/s) of `n` records of `size` bytes on a fresh topic."""
    topic = f"bench-security-{uuid.uuid4().hex[:8]}"
    with secured_env(data_dir):
        asyncio.run(create_topic(bootstrap, topic, 1))
        start, end = asyncio.run(publish(bootstrap, topic, payloads, n))
        assigned, last, nbytes = asyncio.run(consume(bootstrap, topic, n))
    return n * size / MB / (end - start), nbytes / MB / (last - assigned)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="65536,1048576")
    parser.add_argument("--megabytes", type=int, default=64, help="per row and round")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    began = time.monotonic()
    with tempfile.TemporaryDirectory() as plain_dir, tempfile.TemporaryDirectory() as sec_dir:
        plain = broker.start_broker(data_dir=Path(plain_dir), port=broker.free_port())
        secure = broker.start_broker(data_dir=Path(sec_dir), port=broker.free_port(),
                                     secure=True)
        targets = {"plaintext": (plain.bootstrap, None),
                   "TLS+SCRAM": (secure.bootstrap, Path(secure.data_dir))}
        samples: dict[tuple[int, str], list[tuple[float, float]]] = {}
        try:
            for size in sizes:
                payloads = make_payloads(size)
                n = max(1, args.megabytes * MB // size)
                for round_ in range(args.repeats):
                    for mode in MODES:
                        result = one_round(*targets[mode], size, n, payloads)
                        samples.setdefault((size, mode), []).append(result)
                        print(f"# size {size} round {round_} {mode}: publish {result[0]:.1f} "
                              f"MB/s, consume {result[1]:.1f} MB/s", flush=True)
        finally:
            broker.stop_broker(data_dir=Path(plain_dir))
            broker.stop_broker(data_dir=Path(sec_dir))
    print(f"\nload average after: {os.getloadavg()[0]:.1f}; total {time.monotonic() - began:.0f} s\n")
    print("| size | transport | publish MB/s | consume MB/s |")
    print("|---|---|---|---|")
    for size in sizes:
        medians = {mode: [statistics.median(x[i] for x in samples[(size, mode)]) for i in (0, 1)]
                   for mode in MODES}
        for mode in MODES:
            print(f"| {size} | {mode} | {medians[mode][0]:.1f} | {medians[mode][1]:.1f} |")
        ratio = [medians["TLS+SCRAM"][i] / medians["plaintext"][i] for i in (0, 1)]
        print(f"| {size} | ratio secured/plain | {ratio[0]:.2f} | {ratio[1]:.2f} |")


if __name__ == "__main__":
    main()
