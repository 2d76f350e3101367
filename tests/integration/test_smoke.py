"""`miles smoke` on the embedded bus (the Kafka run is in tests/kafka/test_cli.py)."""

import json

from miles.cli import main


def test_smoke_on_embedded(capsys):
    assert main(["smoke", "--bus", "embedded://", "--groups", "20"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["bus"] == "embedded://"
    assert report["groups_consumed"] == 20 and report["dead_lettered"] == 1
