"""`miles export-model`: a trained version becomes a checkpoint `from_pretrained` loads as is
(merged LoRA or full weights) or a peft adapter, with the same function as the learner's."""

import pytest
import torch
from torch.testing import assert_close

from miles.cli import main as cli
from miles.errors import ConfigError
from miles.tasks.tiny_model import build_tiny_model
from miles.trainer import distributed
from miles.trainer.learner import Learner, LearnerConfig
from miles.trainer.model import LoraSettings
from miles.weights.export import export_model
from miles.weights.store import version_dir
from tests.factories import make_group

IDS = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])


@pytest.fixture(autouse=True)
def _process_group():
    yield
    distributed.destroy()


def trained_store(model_dir, store, lora):
    """A store with versions 1 and 2 of a learner; the logits of version 2."""
    learner = Learner(model_dir, LearnerConfig(lr=1e-2, seed=0, precision="fp32"), lora=lora)
    for version in (1, 2):
        learner.train_step([make_group(4, 6, vocab_size=78, seed=s + version) for s in range(3)])
        learner.export_weights(version_dir(store, version))
    learner.model.eval()
    with torch.no_grad():
        return learner.model(input_ids=IDS, use_cache=False).logits


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=IDS, use_cache=False).logits


def test_merged_lora_and_adapter_only_exports_reproduce_the_trained_policy(model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    expected = trained_store(model_dir, tmp_path / "weights", LoraSettings(r=4, alpha=8))
    assert cli(["export-model", "--model-dir", str(model_dir), "--weights",
                str(tmp_path / "weights"), "--out", str(tmp_path / "merged")]) == 0  # newest
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")  # a plain checkpoint
    assert not any("lora" in name for name, _ in merged.named_parameters())
    assert_close(logits(merged), expected, atol=1e-5, rtol=1e-5)
    assert AutoTokenizer.from_pretrained(tmp_path / "merged").encode("12+3") == \
        AutoTokenizer.from_pretrained(model_dir).encode("12+3")
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    assert (logits(base) - expected).abs().max() > 1e-3  # training did change the function

    export_model(model_dir, version_dir(tmp_path / "weights", 2), tmp_path / "adapter",
                 adapter_only=True)
    assert {"adapter_model.safetensors", "adapter_config.json"} <= {
        p.name for p in (tmp_path / "adapter").iterdir()}
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir),
                                        tmp_path / "adapter")
    assert_close(logits(adapted), expected, atol=1e-5, rtol=1e-5)

    export_model(model_dir, tmp_path / "weights", tmp_path / "bf16", dtype="bfloat16")
    half = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    assert half.dtype == torch.bfloat16
    assert_close(logits(half).float(), expected, atol=0.1, rtol=0.05)


def test_full_weights_export_and_refusals(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    expected = trained_store(model_dir, tmp_path / "weights", None)
    export_model(model_dir, tmp_path / "weights", tmp_path / "full")
    assert_close(logits(AutoModelForCausalLM.from_pretrained(tmp_path / "full")), expected,
                 atol=1e-5, rtol=1e-5)
    with pytest.raises(ConfigError, match="no adapter"):
        export_model(model_dir, tmp_path / "weights", tmp_path / "a", adapter_only=True)
    with pytest.raises(ConfigError, match="not empty"):
        export_model(model_dir, tmp_path / "weights", tmp_path / "full")
    with pytest.raises(ConfigError, match="neither a weight version"):
        export_model(model_dir, tmp_path, tmp_path / "b")
    trained_store(model_dir, tmp_path / "lora", LoraSettings(r=4, alpha=8))
    other = build_tiny_model(tmp_path / "other", hidden_size=32, layers=2)
    with pytest.raises(ConfigError, match="does not load onto"):
        export_model(other, tmp_path / "lora", tmp_path / "c")
    assert cli(["export-model", "--model-dir", str(model_dir), "--weights", str(tmp_path),
                "--out", str(tmp_path / "d")]) == 2  # a clear error, no traceback
