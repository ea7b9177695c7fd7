"""Lookahead cache: model-free token-tree proposals from n-gram / trie histories."""
from hetero.core.lookahead_config import CONFIG_FILE_NAME, LookaheadConfig
from lookahead.cache import LookaheadCache
from lookahead.memory import default_memory_budget
from lookahead.stats import HitStats

__all__ = ["CONFIG_FILE_NAME", "HitStats", "LookaheadCache", "LookaheadConfig", "default_memory_budget"]
