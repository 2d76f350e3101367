"""Full-weight versions for the in-process vLLM engine: the checks done before a load, and the
worker extension (`WeightLoader`, mixed into every vLLM worker through `worker_extension_cls`)
that reloads the weights in place. See `miles.engines.vllm_engine` for how loads are ordered
with generation and what a failed load leaves behind."""

from __future__ import annotations

from pathlib import Path

from miles.errors import EngineError

LOAD_WEIGHTS_RPC = "miles_load_safetensors"  # the method `WeightLoader` adds to vLLM's workers


def safetensors_files(weights: Path) -> list[Path]:
    """The `.safetensors` files of a folder (or the one file given), each readable."""
    files = sorted(weights.glob("*.safetensors")) if weights.is_dir() else [weights]
    if not files or not files[0].is_file():
        raise EngineError(f"no .safetensors files in {weights}")
    for path in files:
        if not tensor_shapes([path]):
            raise EngineError(f"weights {path} hold no tensors")
    return files


def tensor_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape in `files`, read from their headers."""
    from safetensors import SafetensorError, safe_open

    shapes = {}
    for path in files:
        try:
            with safe_open(path, framework="pt") as handle:
                shapes.update({k: tuple(handle.get_slice(k).get_shape()) for k in handle.keys()})
        except (OSError, SafetensorError) as err:
            raise EngineError(f"cannot read weights {path}: {err}") from err
    return shapes


def check_covers(shapes: dict[str, tuple[int, ...]], base: dict[str, tuple[int, ...]],
                 weights: Path) -> None:
    """EngineError unless the new weights hold every tensor of the base checkpoint, shaped
    alike, and nothing else: checked before anything is copied, so a refused load changes
    nothing."""
    missing = sorted(set(base) - set(shapes))
    if missing:
        raise EngineError(f"weights {weights} miss {len(missing)} tensors of the checkpoint, "
                          f"e.g. {missing[:5]}")
    unknown = sorted(set(shapes) - set(base))
    if unknown:
        raise EngineError(f"weights {weights} hold tensors the checkpoint lacks: {unknown[:5]}")
    reshaped = [f"{k} {shapes[k]} (was {base[k]})" for k in sorted(base) if shapes[k] != base[k]]
    if reshaped:
        raise EngineError(f"weights {weights} change tensor shapes: {reshaped[:5]}")


class WeightLoader:
    """Mixed into each vLLM worker (`worker_extension_cls`); runs in the worker processes."""

    def miles_load_safetensors(self, files: list[str]) -> list[str]:
        """Copy the tensors of `files` into the model in place; returns the parameters they did
        not cover where that is known (none is a full load). Through the worker's own
        `reload_weights` where vLLM has it: it restores each layer's checkpoint layout, loads,
        and re-runs the processing done after the first load (the CPU backend repacks linear
        weights, for one, so a plain `load_weights` finds parameters of size 0); otherwise
        through the model's `load_weights`."""
        from safetensors.torch import load_file

        if callable(getattr(self, "reload_weights", None)):
            self.reload_weights(weights_iterator=(item for path in files
                                                  for item in load_file(path).items()))
            self._miles_retie_lm_head()
            return []
        model = self.model_runner.model
        expected = {name for name, _ in model.named_parameters()}
        loaded = [model.load_weights(weights=load_file(path).items()) for path in files]
        if any(names is None for names in loaded):  # a model that does not report them
            return []
        return sorted(expected.difference(*loaded))

    def _miles_retie_lm_head(self) -> None:
        """A model whose LM head is tied to its input embeddings: `reload_weights` loads the
        tied tensor through the embeddings and processes it for them only (its docstring says
        so of tied parameters), so the head would keep the form processed from the old weights
        (on CPU a packed matrix) and the logits would come from them. Tie the head again and
        redo its processing."""
        model = self.model_runner.model
        head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        tied = getattr(self.model_runner.model_config.hf_config, "tie_word_embeddings", False)
        if not tied or head is None or embed is None:
            return
        head.weight = embed.weight
        method = getattr(head, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(head)
