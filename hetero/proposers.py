"""Which proposer the engine's configuration asks for: none, the lookahead cache, or a draft model."""
from __future__ import annotations

from typing import Any, Optional

from gpu_target.model_config import ModelConfig
from hetero.core.config import EngineConfig
from hetero.core.protocols import Proposer


def build_proposer(config: EngineConfig, target_config: ModelConfig, tokenizer) -> Optional[Proposer]:
    """A draft model and a lookahead cache both configured: their trees merged (`HybridProposer`)."""
    lookahead = _build_lookahead(config) if config.lookahead is not None else None
    if config.speculative_model:
        from cpu_draft.proposer import build_draft_proposer

        draft = build_draft_proposer(config, target_config, tokenizer)
        if lookahead is None:
            return draft
        from hetero.hybrid_proposer import HybridProposer

        return HybridProposer(draft, lookahead)
    return lookahead


def _build_lookahead(config: EngineConfig) -> Proposer:
    from lookahead import LookaheadCache, default_memory_budget

    return LookaheadCache(config.lookahead, default_memory_budget(config.cpu_decoding_memory_utilization))


def draft_worker(proposer: Optional[Proposer]):
    """The CPU draft worker's proposer (`WorkerDraftProposer`), alone or as the draft inside
    wrappers (`HybridProposer`, a benchmark's replay); else None."""
    from cpu_draft.proposer import WorkerDraftProposer

    while getattr(proposer, "draft", None) is not None:
        proposer = proposer.draft
    return proposer if isinstance(proposer, WorkerDraftProposer) else None


def draft_worker_stats(proposer: Optional[Proposer]) -> Optional[dict[str, Any]]:
    """The CPU draft worker's cumulative counters (`WorkerDraftProposer.stats`: drafting hidden
    behind verification and exposed, draft-ahead hits and misses, restarts, faults), for a
    proposer that has one (`draft_worker`); else None."""
    worker = draft_worker(proposer)
    return worker.stats() if worker is not None else None
