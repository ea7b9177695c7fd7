"""TACO-LLM's lookahead hit statistics.

Per verification step of one sequence: a *hit* is a step that accepted at least one
drafted token; ``hit_len`` counts accepted drafted tokens, ``invalid_len`` drafted tokens
the verifier turned down (all tree nodes off the accepted path).
"""
from __future__ import annotations

from dataclasses import dataclass


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else 0.0


@dataclass
class HitStats:
    num_iters: int = 0
    hit_iters: int = 0
    hit_len: int = 0
    invalid_len: int = 0

    def record(self, num_draft: int, num_accepted: int) -> None:
        self.num_iters += 1
        self.hit_iters += num_accepted > 0
        self.hit_len += num_accepted
        self.invalid_len += max(num_draft - num_accepted, 0)

    @property
    def hit_rate(self) -> float:
        """Share of steps that accepted anything."""
        return _ratio(self.hit_iters, self.num_iters)

    @property
    def global_average_hit_len(self) -> float:
        """Accepted drafted tokens per step, over all steps."""
        return _ratio(self.hit_len, self.num_iters)

    @property
    def valid_average_hit_len(self) -> float:
        """Accepted drafted tokens per step that hit."""
        return _ratio(self.hit_len, self.hit_iters)

    @property
    def hit_valid_rate(self) -> float:
        """Share of drafted tokens that were accepted."""
        return _ratio(self.hit_len, self.hit_len + self.invalid_len)

    def log_line(self) -> str:
        return (
            f"[LookaheadCache] num_iters: {self.num_iters}, hit_iters: {self.hit_iters}, "
            f"hit_len: {self.hit_len}, invalid_len: {self.invalid_len}, "
            f"hit_rate: {self.hit_rate:.4f}, global_average_hit_len: {self.global_average_hit_len:.4f}, "
            f"valid_average_hit_len: {self.valid_average_hit_len:.4f}, "
            f"hit_valid_rate: {self.hit_valid_rate:.4f}"
        )
