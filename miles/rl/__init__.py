"""RL math: sampling distributions, advantages, losses, off-policy corrections. Pure tensor code."""
