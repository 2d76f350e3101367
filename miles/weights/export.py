"""A trained policy as a plain Hugging Face checkpoint: `miles export-model`.

Input: the base model directory the run trained (`trainer.model_dir`) and one version of its
weight store (`<out_dir>/weights/v<N>/`, or the store itself for its newest version). Output:
- merged (default): the base with the version's LoRA update folded into its weights (or the
  version's full weights) saved with `save_pretrained`: config, safetensors, generation config
  and tokenizer, which `AutoModelForCausalLM.from_pretrained` and `vllm serve` load as any
  checkpoint;
- `adapter_only`: the peft adapter (`adapter_config.json` naming the base directory,
  `adapter_model.safetensors`) and the tokenizer: `PeftModel.from_pretrained(base, out)`,
  or a vLLM LoRA module (`--lora-modules name=out`).

Simplifications:
- The merge runs in fp32 on the CPU (no precision lost to a bf16 merge) and the result is cast
  to `dtype` ("auto": the base config's dtype). It holds one whole model in host memory: for a
  70B model that is 280 GB; the adapter-only export needs only the adapter.
- The version folder is trusted as written by the trainer; its sha256 is checked by producers
  against the announcement, which this offline tool does not read.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from miles.errors import ConfigError
from miles.weights.store import WEIGHTS_FILES

DTYPES = ("auto", "float32", "bfloat16", "float16")


def resolve_version(weights: Path) -> Path:
    """`weights` if it is a version folder, else the newest complete version of the store
    `weights`."""
    weights = Path(weights)
    if any((weights / name).is_file() for name in WEIGHTS_FILES.values()):
        return weights
    versions = sorted(p for p in weights.glob("v*") if p.is_dir() and not p.name.endswith(".tmp")
                      and any((p / name).is_file() for name in WEIGHTS_FILES.values()))
    if not versions:
        files = " or ".join(WEIGHTS_FILES.values())
        raise ConfigError(f"{weights} is neither a weight version (no {files}) nor a weight "
                          "store with a complete version")
    return versions[-1]


def version_format(version: Path) -> str:
    """"lora" or "full": what the trainer wrote into `version`."""
    return next(fmt for fmt, name in WEIGHTS_FILES.items() if (version / name).is_file())


def export_model(model_dir: Path, weights: Path, out_dir: Path, *, adapter_only: bool = False,
                 dtype: str = "auto") -> Path:
    """Write the policy of `weights` (a version folder or a store) trained from `model_dir`
    into `out_dir` (see the module docstring); returns the version folder exported."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    version = resolve_version(weights)
    fmt = version_format(version)
    if adapter_only and fmt != "lora":
        raise ConfigError(f"{version} holds full weights: there is no adapter to export alone")
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ConfigError(f"{out_dir} exists and is not empty")
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        config = None if adapter_only else AutoConfig.from_pretrained(model_dir)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model_dir {str(model_dir)!r} could not be loaded: {exc}") from exc
    if adapter_only:
        out_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy2(version / WEIGHTS_FILES["lora"], out_dir / WEIGHTS_FILES["lora"])
        adapter = json.loads((version / "adapter_config.json").read_text())
        adapter["base_model_name_or_path"] = str(Path(model_dir).resolve())
        (out_dir / "adapter_config.json").write_text(json.dumps(adapter, indent=2) + "\n")
        tokenizer.save_pretrained(out_dir)
        return version
    target = (getattr(config, "dtype", None) or "float32") if dtype == "auto" else dtype
    target = getattr(torch, target) if isinstance(target, str) else target  # a str or a dtype
    try:
        if fmt == "full":
            model = AutoModelForCausalLM.from_pretrained(version, dtype=torch.float32)
        else:
            from peft import PeftModel

            base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            model = PeftModel.from_pretrained(base, version).merge_and_unload()
    except (OSError, ValueError, RuntimeError) as exc:  # RuntimeError: shapes of another base
        raise ConfigError(f"{version} does not load onto {model_dir}: {exc}") from exc
    model.to(target).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return version
