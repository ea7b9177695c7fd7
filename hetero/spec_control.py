"""How many tree nodes to verify per sequence this step, so speculation never loses.

Two limits apply. The node budget (`target_parallelism`, summed over the batch) shrinks
trees as the batch grows, because a large batch already fills the GPU. And the
controller measures, per batch-size bucket, the tokens per second that steps with and
without speculation actually deliver (one speculative step, then `min_samples` plain ones,
before the first comparison); where speculating is measured slower it stops,
probing one speculative step every `probe_interval` steps to notice when acceptance
recovers (and one plain step as often while speculating, to keep the comparison fresh).
Each probe that confirms the current choice doubles that bucket's probe interval, up to
`max_probe_interval`; a probe that overturns it resets the interval. A losing option is
therefore tried ever more rarely, which matters at large batches, where one speculative
step costs more than a plain one.
"""
from __future__ import annotations

from dataclasses import dataclass

_EMA = 0.2


@dataclass
class _Throughput:
    tokens_per_second: float = 0.0
    samples: int = 0

    def add(self, value: float) -> None:
        self.tokens_per_second = value if not self.samples else (1 - _EMA) * self.tokens_per_second + _EMA * value
        self.samples += 1


class SpeculationController:
    def __init__(
        self,
        max_nodes_per_seq: int,
        target_parallelism: int,
        probe_interval: int = 16,
        max_probe_interval: int = 1024,
        min_samples: int = 3,
        always_speculate: bool = False,
    ):
        self.max_nodes_per_seq = max_nodes_per_seq
        self.target_parallelism = target_parallelism
        self.probe_interval = probe_interval
        self.max_probe_interval = max_probe_interval
        self.min_samples = min_samples  # plain steps measured before the first comparison
        self.always_speculate = always_speculate  # skip the measurement (tests, cost benchmarks)
        self._speculative: dict[int, _Throughput] = {}
        self._plain: dict[int, _Throughput] = {}
        self._interval: dict[int, int] = {}
        self._countdown: dict[int, int] = {}
        self._winner_at_last_probe: dict[int, bool] = {}

    @staticmethod
    def bucket(num_seqs: int) -> int:
        return 1 << max(num_seqs - 1, 0).bit_length()

    def nodes_per_sequence(self, num_seqs: int) -> int:
        """Tree size to grant each decoding sequence this step (0 = plain decoding)."""
        per_seq = min(self.max_nodes_per_seq, self.target_parallelism // max(num_seqs, 1))
        if per_seq == 0:
            return 0
        bucket = self.bucket(num_seqs)
        spec = self._speculative.setdefault(bucket, _Throughput())
        plain = self._plain.setdefault(bucket, _Throughput())
        if self.always_speculate or not spec.samples:
            return per_seq
        if plain.samples < self.min_samples:
            return 0
        speculation_wins = spec.tokens_per_second >= plain.tokens_per_second
        countdown = self._countdown.get(bucket, self.probe_interval)
        if countdown > 0:
            self._countdown[bucket] = countdown - 1
            return per_seq if speculation_wins else 0
        interval = self._interval.get(bucket, self.probe_interval)
        confirmed = self._winner_at_last_probe.get(bucket) == speculation_wins
        interval = min(interval * 2, self.max_probe_interval) if confirmed else self.probe_interval
        self._interval[bucket] = self._countdown[bucket] = interval
        self._winner_at_last_probe[bucket] = speculation_wins
        return 0 if speculation_wins else per_seq

    def record_step(self, num_seqs: int, speculated: bool, tokens_emitted: int, seconds: float) -> None:
        """Measured outcome of one decode step."""
        if seconds <= 0:
            return
        table = self._speculative if speculated else self._plain
        table.setdefault(self.bucket(num_seqs), _Throughput()).add(tokens_emitted / seconds)

    def speculation_pays(self, num_seqs: int) -> bool | None:
        """Whether speculation measured faster at this batch size (None before both were measured)."""
        bucket = self.bucket(num_seqs)
        spec, plain = self._speculative.get(bucket), self._plain.get(bucket)
        if not spec or not plain or not spec.samples or plain.samples < self.min_samples:
            return None
        return spec.tokens_per_second >= plain.tokens_per_second
