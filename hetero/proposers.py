"""Which proposer the engine's configuration asks for: none, the lookahead cache, or a draft model."""
from __future__ import annotations

import dataclasses
from typing import Optional

from gpu_target.model_config import ModelConfig
from hetero.core.config import EngineConfig
from hetero.core.protocols import Proposer


def build_proposer(config: EngineConfig, target_config: ModelConfig, tokenizer) -> Optional[Proposer]:
    """A draft model and a lookahead cache both configured: their trees merged (`HybridProposer`)."""
    lookahead = _build_lookahead(config) if config.lookahead_cache_config_dir or config.uses_ngram else None
    if config.speculative_model:
        from cpu_draft.proposer import build_draft_proposer

        draft = build_draft_proposer(config, target_config, tokenizer)
        if lookahead is None:
            return draft
        from hetero.hybrid_proposer import HybridProposer

        return HybridProposer(draft, lookahead)
    return lookahead


def _build_lookahead(config: EngineConfig) -> Proposer:
    from lookahead import LookaheadCache, LookaheadConfig, default_memory_budget

    if config.uses_ngram:
        spec = config.speculative_config
        lookahead_config = LookaheadConfig.from_ngram(
            num_speculative_tokens=spec.get("num_speculative_tokens", 5),
            prompt_lookup_max=spec.get("prompt_lookup_max"),
            prompt_lookup_min=spec.get("prompt_lookup_min"),
        )
    else:
        lookahead_config = LookaheadConfig.from_dir(config.lookahead_cache_config_dir)
    if config.ignore_prompt_for_lookahead_cache:
        lookahead_config = dataclasses.replace(lookahead_config, ignore_prompt=True)
    return LookaheadCache(lookahead_config, default_memory_budget(config.cpu_decoding_memory_utilization))
