"""The README's "Write an environment" example, as it is printed there (a test holds the two
to each other and runs the README's command): a tool the model calls with
`<tool>word_length: banana</tool>` before it answers; `words.jsonl` is its data."""

from miles.envs import ToolEnvironment


def word_length(word: str) -> int:
    """The number of letters in a word."""
    return len(word)


class WordLengths(ToolEnvironment):
    tool_style = "text"            # <tool>word_length: banana</tool>; stop string </tool>
    tools = (word_length,)
