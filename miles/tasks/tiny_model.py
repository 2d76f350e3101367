"""A tiny Llama- or Qwen2-style causal LM and a character tokenizer, built from configs.

Nothing is downloaded: the tokenizer is assembled with the `tokenizers` library and saved with
`save_pretrained`, the model is initialised from a config and saved next to it. Everything else
in Miles loads the result with `AutoTokenizer/AutoModelForCausalLM.from_pretrained(directory)`,
the same path a real checkpoint takes.

The tokenizer is one token per character over a small alphabet (digits, arithmetic signs, letters,
punctuation), so arithmetic answers are short and every string of the task has exactly one
tokenization. `chat=True` adds the characters of tags (`<`, `>`, `_`, newline) and a real chat
template (`CHAT_TEMPLATE`, Jinja, saved with the tokenizer like any checkpoint's): each message is
`<role>content`, an assistant's closed by EOS, then a newline; the generation prompt is
`<assistant>`. The vocabulary of the plain tokenizer (78 tokens) is unchanged.

`build_bpe_tokenizer` trains a tiny byte-level BPE on a given corpus instead, for what the
character tokenizer cannot show: a text with several tokenizations (a model may sample one
that is not the tokenizer's own), and any character (JSON of tool schemas).
"""

from __future__ import annotations

import string
from pathlib import Path

SPECIAL_TOKENS = {"pad": "<pad>", "bos": "<s>", "eos": "</s>", "unk": "<unk>"}
ALPHABET = string.digits + "+-*/=()., ?:" + string.ascii_letters
CHAT_CHARACTERS = "<>_\n"  # added by chat=True, after ALPHABET (so the other ids stay)
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<' + message['role'] + '>' + message['content'] -}}"
    "{%- if message['role'] == 'assistant' -%}{{- eos_token -}}{%- endif -%}"
    "{{- '\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<assistant>' -}}{%- endif -%}")


def build_char_tokenizer(*, chat: bool = False, chat_template: str = CHAT_TEMPLATE):
    """A `PreTrainedTokenizerFast` with one token per character of `ALPHABET` (and, with
    `chat`, of `CHAT_CHARACTERS`, and `chat_template` as its chat template)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    characters = ALPHABET + (CHAT_CHARACTERS if chat else "")
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS.values(), *characters])}
    core = Tokenizer(models.WordLevel(vocab, unk_token=SPECIAL_TOKENS["unk"]))
    any_character = "(?m)." if chat else "."  # Oniguruma's (?m): "." matches a newline too
    core.pre_tokenizer = pre_tokenizers.Split(Regex(any_character), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=SPECIAL_TOKENS["bos"], eos_token=SPECIAL_TOKENS["eos"],
        pad_token=SPECIAL_TOKENS["pad"], unk_token=SPECIAL_TOKENS["unk"])
    if chat:
        tokenizer.chat_template = chat_template
    return tokenizer


def build_bpe_tokenizer(corpus: list[str], *, vocab_size: int = 400,
                        chat_template: str = CHAT_TEMPLATE):
    """A `PreTrainedTokenizerFast`: byte-level BPE trained on `corpus` (every byte is a token,
    frequent pairs merge), the special tokens of the character tokenizer, `chat_template`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  special_tokens=list(SPECIAL_TOKENS.values()),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=SPECIAL_TOKENS["bos"], eos_token=SPECIAL_TOKENS["eos"],
        pad_token=SPECIAL_TOKENS["pad"], unk_token=SPECIAL_TOKENS["unk"])
    tokenizer.chat_template = chat_template
    return tokenizer


def build_tiny_model(out_dir: str | Path, *, arch: str = "llama", hidden_size: int = 128,
                     layers: int = 4, heads: int = 4, kv_heads: int = 2,
                     max_positions: int = 64, seed: int = 0, tied: bool = True,
                     chat: bool = False) -> Path:
    """Write a freshly initialised tiny causal LM and its tokenizer to `out_dir` (`tied`: the
    LM head shares the input embeddings; `chat`: the chat tokenizer and template)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if arch not in ("llama", "qwen2"):
        raise ValueError(f"arch must be 'llama' or 'qwen2', got {arch!r}")
    tokenizer = build_char_tokenizer(chat=chat)
    config = AutoConfig.for_model(
        arch, vocab_size=len(tokenizer), hidden_size=hidden_size,
        intermediate_size=hidden_size * 4, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions, tie_word_embeddings=tied,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
