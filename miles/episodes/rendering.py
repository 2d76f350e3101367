"""Token-in, token-out: an episode's context as token ids, extended once per observation.

The context of an episode is the first prompt's ids followed by every turn's sampled ids and
observation ids, never re-tokenized: what the trainer scores is what the engine sampled.
- A text observation is appended as `engine.encode(text)`.
- A chat episode (the task's prompt, or `reset`'s first observation, is messages) renders its
  first prompt with the tokenizer's chat template (`add_generation_prompt=True`, and the
  environment's `tool_schemas()` as `tools=` when it has any, as Qwen's and Hermes' templates
  describe them). Each later observation renders the whole conversation (the messages so far,
  the model's turn as an `assistant` message holding its decoded text, then the observation's
  messages) as text, which must start with the text of the context: the last rendering, then
  the model's turn exactly as sampled (its ids decoded, special tokens included). Only the rest
  is tokenized and appended after the sampled ids (for a typical template: the end-of-turn
  marker the model did not sample when a stop string ended its turn, the observation, the next
  generation prompt). Checking text rather than ids keeps a turn the model sampled as another
  tokenization of its text than the tokenizer's own (BPE has many); a template that rewrites
  earlier turns (strips or trims them) breaks the text, and the episode then fails
  (`EpisodeError`, kind "template") with the first differing character, rather than train on
  tokens the model never saw.

Choices: rendered text is tokenized with `encode(..., add_special_tokens=False)` (a template
writes its own BOS); a turn's ids are decoded after the last rendered token (so a tokenizer that
drops a leading space at the start of a decode, as SentencePiece's does, keeps it) without
clean-up of spaces; the new part of a rendering is tokenized on its own, so its first token
never merges with the model's last one (a SentencePiece tokenizer that prepends a space to a
text it encodes would add one there: byte-level BPE, as Qwen's and Llama 3's, does not); a text
observation in a chat episode is appended as is and ends the conversation's rendering (a later
chat observation fails); a chat observation in a text episode fails (give the task as messages).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from miles.envs import Observation, Task
from miles.errors import ConfigError, EpisodeError, MilesError
from miles.protocol import PromptTask
from miles.tasks.messages import MESSAGES_KEY, parse_messages


@dataclass
class Context:
    """An episode's tokens so far (the first prompt, then the response) and, for a chat
    episode, the conversation they render."""

    ids: list[int]
    prompt_length: int
    messages: list[dict[str, str]] | None = None
    raw: bool = False  # a text observation joined a chat episode: no more chat rendering
    text: str = ""
    """The conversation's last rendering, of which `ids[:rendered]` is a tokenization."""
    rendered: int = 0
    tools: list[dict[str, Any]] | None = None
    """The environment's tool schemas, passed to the chat template as `tools=`."""


def task_of(prompt: PromptTask) -> Task:
    """The environment's `Task` of a prompt: chat messages from `metadata["messages"]` (a JSON
    list of {"role", "content"}) when present, else the prompt text; EpisodeError ("bad_task")
    if the messages are not valid."""
    metadata = dict(prompt.metadata)
    raw = metadata.get(MESSAGES_KEY)
    if raw is None:
        return Task(prompt.prompt, prompt.reference, metadata)
    try:
        return Task(parse_messages(raw), prompt.reference, metadata)
    except (ValueError, MilesError) as err:
        raise EpisodeError("bad_task", f"metadata.{MESSAGES_KEY} is not a JSON list of "
                                      f"messages: {err}") from None


def prompt_ids(engine, prompt: PromptTask) -> list[int]:
    """The ids a prompt starts from, on every path (single-turn, episodes, evaluation): a
    conversation's chat rendering, else `prompt_token_ids`, else the encoded prompt text;
    EpisodeError ("bad_task", "template") if the conversation is malformed or does not render."""
    if MESSAGES_KEY in prompt.metadata:
        return Renderer(engine).first(task_of(prompt), None, None).ids
    if prompt.prompt_token_ids is not None:
        return prompt.prompt_token_ids.tolist()
    return engine.encode(prompt.prompt)


def unknown_token_id(engine) -> int | None:
    """The id of the engine's tokenizer's unknown token (None: none, or no tokenizer here)."""
    return getattr(getattr(engine, "tokenizer", None), "unk_token_id", None)


def check_stop_strings(engine, factory) -> None:
    """ConfigError, at start-up, if the environment has more stop strings than the engine takes
    in a request (`max_stop_strings`: a vLLM server 4, else 16), or if one encodes to the
    engine's unknown token: the model could never write it (a turn would never end on a tool
    call) and observations in the same characters would reach it as unknown tokens. Read from the
    environment class (`factory` or the `functools.partial` around it); a factory of another
    kind is not checked."""
    target = getattr(factory, "func", factory)
    if not isinstance(target, type):
        return
    stops = getattr(target, "stop_strings", ())
    if len(stops) > engine.max_stop_strings:
        raise ConfigError(
            f"env {target.__module__}.{target.__qualname__}: its {len(stops)} stop strings are "
            f"more than engine {engine.name!r} takes ({engine.max_stop_strings} per request): "
            f"every turn would be refused. Use fewer stop strings in the environment, or "
            f"another engine")
    unk = unknown_token_id(engine)
    if unk is None:
        return
    for stop in stops:
        if unk in engine.encode(stop):
            raise ConfigError(
                f"env {target.__module__}.{target.__qualname__}: its stop string {stop!r} "
                f"encodes to the unknown token with engine {engine.name!r}'s tokenizer: the "
                "model could never end a turn with it. Use a tokenizer that has its characters "
                "(the built-in tiny model's chat tokenizer, chosen whenever `env` is set, has "
                "'<', '>', '_')")


class Renderer:
    """Renders an engine's episodes: text via `engine.encode`, chat via its tokenizer."""

    def __init__(self, engine):
        self.engine = engine
        self.tokenizer = getattr(engine, "tokenizer", None)
        self.unk_id = unknown_token_id(engine)

    def unknown(self, ids: list[int]) -> bool:
        """Whether `ids` hold the tokenizer's unknown token (text the model cannot read)."""
        return self.unk_id is not None and self.unk_id in ids

    def first(self, task: Task, first: Observation | None, prompt_ids: list[int] | None,
              tools: list[dict[str, Any]] | None = None) -> Context:
        """The context of a new episode: `first` (reset's observation; None: the task's prompt,
        whose `prompt_ids` are used when given and the prompt is text); `tools`: schemas for
        the chat template."""
        observation = task.prompt if first is None else first
        if isinstance(observation, str):
            ids = prompt_ids if first is None and prompt_ids else self.engine.encode(observation)
            return Context(ids=list(ids), prompt_length=len(ids))
        messages = [dict(m) for m in observation]
        text = self._render(messages, tools)
        ids = self._tokenize(text)
        return Context(ids=ids, prompt_length=len(ids), messages=messages, text=text,
                       rendered=len(ids), tools=tools or None)

    def extend(self, context: Context, action_text: str, observation: Observation) -> list[int]:
        """The ids `observation` adds after the model's turn (whose ids are already in the
        context; the caller appends these); updates the conversation."""
        if isinstance(observation, str):
            if context.messages is not None:
                context.raw = True
            return self.engine.encode(observation)
        if context.messages is None:
            raise EpisodeError("template", "a chat observation in an episode whose prompt is "
                                          "plain text (give the task as messages)")
        if context.raw:
            raise EpisodeError("template", "a chat observation after a text observation: the "
                                          "conversation no longer renders the context")
        messages = [*context.messages, {"role": "assistant", "content": action_text},
                    *(dict(m) for m in observation)]
        text = self._render(messages, context.tools)
        turn = self._sampled_text(context)
        have = context.text + turn
        if not text.startswith(have):
            raise EpisodeError("template", _mismatch(context.text, turn, text))
        ids = self._tokenize(text[len(have):])
        context.messages, context.text = messages, text
        context.rendered = len(context.ids) + len(ids)
        return ids

    def _sampled_text(self, context: Context) -> str:
        """The text of the ids after the last rendering, decoded after its last token."""
        anchor = context.ids[context.rendered - 1:context.rendered]
        decode = functools.partial(self.tokenizer.decode, skip_special_tokens=False,
                                   clean_up_tokenization_spaces=False)
        return decode(anchor + context.ids[context.rendered:])[len(decode(anchor)):]

    def _render(self, messages: list[dict[str, str]], tools: list[dict[str, Any]] | None) -> str:
        template = getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise EpisodeError("template", f"engine {self.engine.name!r} has no tokenizer with a "
                                          "chat template, and the episode is a conversation")
        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools,
                                                      add_generation_prompt=True, tokenize=False)
        except Exception as err:  # a template is user code (Jinja): any failure is its own
            raise EpisodeError("template", f"the chat template failed: {type(err).__name__}: "
                                          f"{err}") from None

    def _tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))


def _mismatch(before: str, turn: str, rendered: str) -> str:
    have = before + turn
    at = next((i for i, (a, b) in enumerate(zip(have, rendered)) if a != b), len(rendered))
    where = (f"character {at} of the conversation so far" if at < len(before) else
             f"character {at - len(before)} of the model's last turn")
    return (f"the chat template's rendering of the conversation does not extend the text so "
            f"far: at {where} the context has {have[at:at + 20]!r} and the rendering "
            f"{rendered[at:at + 20]!r} (a template that rewrites earlier turns); the episode is "
            "not trained on tokens the model never saw")
