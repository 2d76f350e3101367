"""Token-in, token-out: an episode's context as token ids, extended once per observation.

The context of an episode is the first prompt's ids followed by every turn's sampled ids and
observation ids, never re-tokenized: what the trainer scores is what the engine sampled.
- A text observation is appended as `engine.encode(text)`.
- A chat episode (the task's prompt, or `reset`'s first observation, is messages) renders its
  first prompt with the tokenizer's chat template (`add_generation_prompt=True`). Each later
  observation renders the whole conversation (the messages so far, the model's turn as an
  `assistant` message holding its decoded text, then the observation's messages) and its
  ids must start with the context's ids exactly; the rest are the observation's ids (for a
  typical template: the end-of-turn marker the model did not sample when a stop string ended
  its turn, the observation, the next generation prompt). A template that rewrites earlier
  turns (strips or trims them), or a turn whose sampled ids differ from how its text
  tokenizes, breaks that; the episode then fails (`EpisodeError`, kind "template") with the
  first differing position, rather than train on tokens the model never saw.

Choices: rendered text is tokenized with `encode(..., add_special_tokens=False)` (a template
writes its own BOS); a text observation in a chat episode is appended as is and ends the
conversation's rendering (a later chat observation fails); a chat observation in a text
episode fails (give the task as messages).
"""

from __future__ import annotations

from dataclasses import dataclass

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
    """ConfigError, at start-up, if the environment's stop strings encode to the engine's
    unknown token: the model could never write them (a turn would never end on a tool call)
    and observations in the same characters would reach it as unknown tokens. Read from the
    environment class (`factory` or the `functools.partial` around it); a factory of another
    kind is not checked."""
    target = getattr(factory, "func", factory)
    unk = unknown_token_id(engine)
    if unk is None or not isinstance(target, type):
        return
    for stop in getattr(target, "stop_strings", ()):
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

    def first(self, task: Task, first: Observation | None,
              prompt_ids: list[int] | None) -> Context:
        """The context of a new episode: `first` (reset's observation; None: the task's prompt,
        whose `prompt_ids` are used when given and the prompt is text)."""
        observation = task.prompt if first is None else first
        if isinstance(observation, str):
            ids = prompt_ids if first is None and prompt_ids else self.engine.encode(observation)
            return Context(ids=list(ids), prompt_length=len(ids))
        messages = [dict(m) for m in observation]
        ids = self._render(messages)
        return Context(ids=ids, prompt_length=len(ids), messages=messages)

    def extend(self, context: Context, action_text: str, observation: Observation) -> list[int]:
        """The ids `observation` adds after the model's turn (whose ids are already in the
        context); updates the conversation."""
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
        ids = self._render(messages)
        have = context.ids
        if ids[:len(have)] != have:
            at = next((i for i, (a, b) in enumerate(zip(have, ids)) if a != b), len(ids))
            raise EpisodeError("template", _mismatch(have, ids, at, context.prompt_length))
        context.messages = messages
        return ids[len(have):]

    def _render(self, messages: list[dict[str, str]]) -> list[int]:
        template = getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise EpisodeError("template", f"engine {self.engine.name!r} has no tokenizer with a "
                                          "chat template, and the episode is a conversation")
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                      tokenize=False)
        except Exception as err:  # a template is user code (Jinja): any failure is its own
            raise EpisodeError("template", f"the chat template failed: {type(err).__name__}: "
                                          f"{err}") from None
        return list(self.tokenizer.encode(text, add_special_tokens=False))


def _mismatch(have: list[int], rendered: list[int], at: int, prompt_length: int) -> str:
    where = "the first prompt" if at < prompt_length else f"response token {at - prompt_length}"
    got = rendered[at] if at < len(rendered) else "the end"
    return (f"the chat template's rendering of the conversation does not extend the tokens so "
            f"far: at {where} the context has {have[at]} and the rendering {got} (a template "
            "that rewrites earlier turns, or a turn whose text tokenizes differently from "
            "what was sampled); the episode is not trained on tokens the model never saw")
