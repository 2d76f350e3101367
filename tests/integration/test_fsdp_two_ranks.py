"""Two FSDP2 ranks (torchrun, gloo, CPU) take the same step as one rank, gradients do not
depend on ranks, micro-batching or sequence packing, and both ranks isolate the same failing
groups as one rank does although only one of them sees the failure.

Each run is a subprocess (`fsdp_worker.py`), so no process group leaks into the test process.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.testing import assert_close

from miles.tasks.tiny_model import build_tiny_model
from miles.trainer.checkpoint import checkpoint_dir

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("fsdp_worker.py")
WORKER_TIMEOUT_S = 280  # generous: the 2 CPU cores may be shared with other jobs


def run_worker(model_dir: Path, out_dir: Path, ranks: int | None, algo: str,
               resume: Path | None = None) -> dict | None:
    """Run the worker on `ranks` torchrun ranks (None: plain python, one self-made rank)."""
    out_dir.mkdir()
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                 f"--nproc_per_node={ranks}"] if ranks else [sys.executable])
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           "CUDA_VISIBLE_DEVICES": ""}
    args = [str(WORKER), str(model_dir), str(out_dir), algo] + ([str(resume)] if resume else [])
    done = subprocess.run([*launcher, *args], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=WORKER_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    metrics = out_dir / "metrics.json"
    return json.loads(metrics.read_text()) if metrics.exists() else None


@pytest.mark.slow
@pytest.mark.timeout(2 * WORKER_TIMEOUT_S + 60)
@pytest.mark.parametrize("algo", ["grpo", "ppo"])  # ppo: GAE whitening and value loss too
def test_two_ranks_match_one_rank(tmp_path, algo):
    model_dir = build_tiny_model(tmp_path / "tiny", hidden_size=64, layers=2)
    one = run_worker(model_dir, tmp_path / "one", ranks=None, algo=algo)
    two = run_worker(model_dir, tmp_path / "two", ranks=2, algo=algo)
    assert (one["world_size"], two["world_size"]) == (1, 2)
    assert two["micro_batches"] < one["micro_batches"]  # the work was split
    for key in ("trainer/tokens", "trainer/is_truncated_frac"):
        assert two[key] == pytest.approx(one[key], abs=1e-9), key
    for key in ("trainer/loss", "trainer/grad_norm", "trainer/is_weight_mean",
                "trainer/is_weight_max", "trainer/kl_behaviour", "trainer/mismatch",
                "trainer/reward_mean", *(("trainer/value_loss", "trainer/return_mean")
                                         if algo == "ppo" else ())):
        assert two[key] == pytest.approx(one[key], rel=1e-5, abs=1e-6), key
    one_adapter = load_file(tmp_path / "one" / "adapter" / "adapter_model.safetensors")
    two_adapter = load_file(tmp_path / "two" / "adapter" / "adapter_model.safetensors")
    assert one_adapter.keys() == two_adapter.keys() and one_adapter
    for name, tensor in one_adapter.items():
        assert_close(two_adapter[name], tensor, atol=1e-5, rtol=0, msg=name)
    trained = [n for n in one_adapter if "lora_B" in n]
    assert all(torch.count_nonzero(one_adapter[n]) for n in trained)  # the step did move B


@pytest.mark.slow
@pytest.mark.timeout(2 * WORKER_TIMEOUT_S + 60)
def test_gradients_are_the_same_for_any_ranks_micro_batches_and_packing(tmp_path):
    """For each loss aggregation (and GSPO's sequence ratios, PPO's critic): the gradients of
    one step on 1 rank, padded, in one micro-batch are those of 2 ranks, of packed rows, and of
    several micro-batches, in every combination (full fine-tuning: every weight has one). The
    model's LM head is untied, so embeddings and head are FSDP2 units of their own."""
    model_dir = build_tiny_model(tmp_path / "tiny", hidden_size=64, layers=2, tied=False)
    runs = {}
    for ranks in (None, 2):
        out = tmp_path / f"ranks-{ranks or 1}"
        run_worker(model_dir, out, ranks=ranks, algo="gradients")
        runs[ranks or 1] = load_file(out / "gradients.safetensors")
        counts = json.loads((out / "micro_batches.json").read_text())
        assert all(counts[k] > counts[k.replace("/many", "/one")] for k in counts
                   if k.endswith("/many"))  # the small budget did split the work
    assert runs[1].keys() == runs[2].keys()
    references = {}
    for key in runs[1]:
        case, _, _, name = key.split("/", 3)
        reference = runs[1][f"{case}/padded/one/{name}"]
        references.setdefault(case, {})[name] = reference
        for ranks, grads in runs.items():
            assert_close(grads[key], reference, rtol=1e-4, atol=1e-6 * float(
                reference.abs().max()), msg=f"{ranks} rank(s): {key}")
    token_mean = references["token_mean"]
    assert all(torch.count_nonzero(g) for g in token_mean.values())
    for case in ("seq_mean_token_mean", "seq_sum_constant"):  # the cases do differ
        assert any(not torch.allclose(references[case][n], g, rtol=1e-2)
                   for n, g in token_mean.items()), case


def load_adapter(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "adapter_model.safetensors")


@pytest.mark.slow
@pytest.mark.timeout(2 * WORKER_TIMEOUT_S + 60)
def test_a_checkpoint_saved_on_two_ranks_restarts_on_one(tmp_path):
    """Weights and optimizer state reshard: one rank resuming from a two-rank checkpoint
    takes the same second step as the two ranks did."""
    model_dir = build_tiny_model(tmp_path / "tiny", hidden_size=64, layers=2)
    run_worker(model_dir, tmp_path / "two", ranks=2, algo="grpo")
    checkpoint = checkpoint_dir(tmp_path / "two" / "ckpt", 1)
    run_worker(model_dir, tmp_path / "one", ranks=None, algo="grpo", resume=checkpoint)
    two = load_adapter(tmp_path / "two" / "adapter2")
    one = load_adapter(tmp_path / "one" / "adapter2")
    first = load_adapter(tmp_path / "two" / "adapter")
    assert one.keys() == two.keys() and one
    for name, tensor in two.items():
        assert_close(one[name], tensor, atol=1e-5, rtol=0, msg=name)
    assert any(not torch.equal(two[n], first[n]) for n in two)  # the second step moved them


@pytest.mark.slow
@pytest.mark.timeout(2 * WORKER_TIMEOUT_S + 60)
def test_two_ranks_isolate_the_groups_only_one_rank_sees_fail(tmp_path):
    """Groups 1 (NaN in the forward) and 3 (a batching error) are both in rank 1's share:
    rank 0 must reach the same verdicts, probes and update, or the ranks would deadlock."""
    model_dir = build_tiny_model(tmp_path / "tiny", hidden_size=64, layers=2)
    run_worker(model_dir, tmp_path / "one", ranks=None, algo="isolation")
    run_worker(model_dir, tmp_path / "two", ranks=2, algo="isolation")
    reports = [json.loads((tmp_path / folder / f"isolation-{rank}.json").read_text())
               for folder, rank in (("one", 0), ("two", 0), ("two", 1))]
    assert [r["world_size"] for r in reports] == [1, 2, 2]
    for report in reports:
        assert report["trained"] == [0, 2, 4, 5] and sorted(report["failed"]) == ["1", "3"]
        assert report["policy_version"] == 1
        assert report["failed"]["1"].startswith("step non-finite: grad_norm=nan")
        assert "temperature=0.0" in report["failed"]["3"]
    assert reports[1] == reports[2], "the ranks disagree"
    assert reports[0]["tokens"] == reports[1]["tokens"]
