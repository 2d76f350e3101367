"""Environments for multi-turn episodes: the contract, tools, and the sandboxed interpreter."""
