"""Runnable examples from the README (`python -m miles.cli demo --env examples.envs....`)."""
