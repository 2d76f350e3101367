"""Built-in tasks, reward functions, and the tiny model/tokenizer factory for tests and the demo."""
