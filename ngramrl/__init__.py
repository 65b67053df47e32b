"""ngramrl: per-prompt n-gram drafting from recent RL rollouts, verified exactly."""

from ngramrl.config import DrafterConfig, HistoryConfig, NgramRLConfig, PrefetchConfig
from ngramrl.core.drafter import Draft, NgramDrafter, RequestState
from ngramrl.core.history import RolloutHistory

__all__ = ["Draft", "DrafterConfig", "HistoryConfig", "NgramDrafter", "NgramRLConfig", "PrefetchConfig",
           "RequestState", "RolloutHistory"]
__version__ = "0.1.0"
