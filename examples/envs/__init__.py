"""Example environments: the README's "Write an environment" (`word_lengths`), with its data."""
