"""A task given as a conversation: what a dataset row's `messages` and the wire's
`PromptTask.metadata["messages"]` may hold, checked the same way on both sides.

A conversation is a non-empty list of `{"role", "content"}` maps (role one of `MESSAGE_ROLES`,
content a string; other keys are kept for the chat template). It travels as one JSON string
(`messages_json`), since the wire's metadata holds scalars only. The bounds are sanity guards
against a runaway row or a hostile record, not tuning knobs: the record size bounds the rest.

Its plain text (`messages_text`: the contents joined by newlines) is the `Problem`'s prompt
string, what a reward function is given as the prompt and what logs show; the model itself
sees the chat template's rendering (`miles.episodes.rendering`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

MESSAGES_KEY = "messages"
"""The `PromptTask.metadata` key holding a conversation (a JSON string, `messages_json`)."""
MESSAGE_ROLES = ("system", "user", "assistant", "tool")
MAX_MESSAGES = 1024
"""Most messages in one task's conversation."""
MAX_MESSAGES_CHARS = 1 << 20
"""Longest conversation, in characters of its JSON form."""

Conversation = tuple[dict, ...]


def check_messages(value: object) -> Conversation:
    """`value` as a conversation of plain dicts; ValueError saying what is wrong."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value:
        raise ValueError(f"must be a non-empty list of messages, got {type(value).__name__}")
    if len(value) > MAX_MESSAGES:
        raise ValueError(f"has more than {MAX_MESSAGES} messages ({len(value)})")
    messages = []
    for index, message in enumerate(value):
        if not (isinstance(message, Mapping) and isinstance(message.get("content"), str)
                and message.get("role") in MESSAGE_ROLES):
            raise ValueError(f"message {index} must be a mapping with a role in {MESSAGE_ROLES} and a "
                             f"string content, got {_short(message)}")
        messages.append(dict(message))
    if len(messages_json(messages)) > MAX_MESSAGES_CHARS:
        raise ValueError(f"is longer than {MAX_MESSAGES_CHARS} characters as JSON")
    return tuple(messages)


def parse_messages(raw: object) -> Conversation:
    """A conversation from its wire form (a JSON string); ValueError if it is not one."""
    if not isinstance(raw, str):
        raise ValueError(f"must be a JSON string, got {type(raw).__name__}")
    if len(raw) > MAX_MESSAGES_CHARS:
        raise ValueError(f"is longer than {MAX_MESSAGES_CHARS} characters")
    return check_messages(json.loads(raw))


def messages_json(messages: Sequence[Mapping]) -> str:
    return json.dumps(list(map(dict, messages)), ensure_ascii=False, separators=(",", ":"))


def messages_text(messages: Sequence[Mapping]) -> str:
    """The conversation as one string: its contents joined by newlines."""
    return "\n".join(message["content"] for message in messages)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
