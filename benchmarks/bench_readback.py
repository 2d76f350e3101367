"""How fast a recorded trajectories topic reads back: the rate replay and export can be fed.

Run by hand against a broker holding a run (e.g. after a Kafka `miles demo`):

    python benchmarks/bench_readback.py --bus kafka://127.0.0.1:29092 --run RUN

Reads the whole topic in the order replay uses (`miles.bus.ranges.read_range`, a fresh consumer
group) and decodes every record with full validation, as the trainer does; prints groups, bytes
and groups/s with and without the group join. Results in `docs/experience.md`.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid

from miles.bus import open_bus
from miles.bus.ranges import parse_bound, read_range
from miles.protocol import TrajectoryGroup, decode
from miles.protocol.topics import topic_name


async def read_back(url: str, run: str) -> dict:
    async with open_bus(url) as bus:
        began = time.perf_counter()
        first = None
        groups = size = 0
        async for record in read_range(bus, topic_name(run, "trajectories"),
                                       parse_bound("earliest"), parse_bound("latest"),
                                       group_id=f"bench-readback-{uuid.uuid4().hex[:8]}"):
            first = first or time.perf_counter()
            decode(record.value, TrajectoryGroup)
            groups, size = groups + 1, size + len(record.value)
        done = time.perf_counter()
    return {"groups": groups, "bytes": size, "seconds": round(done - began, 3),
            "groups_per_s": round(groups / (done - began)),
            "groups_per_s_after_join": round(groups / (done - (first or began)))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bus", required=True, help="kafka://HOST:PORT")
    parser.add_argument("--run", required=True)
    args = parser.parse_args()
    print(asyncio.run(read_back(args.bus, args.run)))


if __name__ == "__main__":
    main()
