"""Multi-turn episodes in the producer: the runner, token-in/token-out rendering, the record.

`EpisodeRunner` runs `sampling.n` episodes per prompt against an environment factory
(`miles.envs.load_environment`), batching every ready episode's next turn into one engine call;
`Renderer` keeps each episode's context as exact token ids (chat templates checked to extend
them); `EpisodeRecord.sample()` is the wire `Sample` (1.4 episode fields). The producer
(`miles.rollout`) uses them when its `env` setting is set. See docs/environments.md.
"""

from miles.episodes.rendering import (MESSAGES_KEY, Context, Renderer, check_stop_strings,
                                      prompt_ids, task_of)
from miles.episodes.runner import (EpisodeRunner, EpisodeSettings, context_warning, is_single_turn,
                                   within_budget)
from miles.episodes.samples import EpisodeRecord, Turn

__all__ = ["MESSAGES_KEY", "Context", "EpisodeRecord", "EpisodeRunner", "EpisodeSettings",
           "Renderer", "Turn", "check_stop_strings", "context_warning", "is_single_turn",
           "prompt_ids", "task_of", "within_budget"]
