"""Lookahead cache: model-free token-tree proposals from n-gram / trie histories."""
from lookahead.cache import LookaheadCache
from lookahead.config import CONFIG_FILE_NAME, LookaheadConfig
from lookahead.memory import default_memory_budget
from lookahead.stats import HitStats

__all__ = ["CONFIG_FILE_NAME", "HitStats", "LookaheadCache", "LookaheadConfig", "default_memory_budget"]
