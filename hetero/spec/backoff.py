"""Per-sequence back-off of drafts that keep missing (`DraftBackoff`)."""
from __future__ import annotations




class DraftBackoff:
    """Whether one sequence gets a tree this step, judged by its own recent acceptance.

    The batch-level verdict cannot see a sequence whose drafts are useless: a batch that
    speculates well shrinks, as its requests finish, to a straggler whose drafts all miss,
    and every speculative step then emits one token at more than a plain step's cost
    (and a speculative step gives up the multi-step windows plain decoding runs in).

    After `MISSES_BEFORE_BACKOFF` speculative steps in a row that accepted no draft token,
    the sequence gets no tree for a back-off of `FIRST_BACKOFF` of its decode steps; then
    one tree again as a probe. A probe that misses too doubles the back-off, up to
    `MAX_BACKOFF`, so a sequence whose drafts stay useless costs one speculative step per
    ever longer stretch of plain decoding; any accepted token ends the back-off (drafts
    that start to fit, say text the lookahead cache has seen, are used again). A run of
    misses, not a rate: a sequence that accepts now and then keeps its tree, and the
    state is three ints, cheap enough for every sequence of a 256-sequence step.

    Whether a tree accepts nothing depends on its first node only, so a run of misses has
    probability (1 - p)^n for drafts right with probability p, whatever the tree size. At
    p = 0.6 a run of 4 turns up by chance in most sequences of a 100-step batch, and a run
    of 8 is still 5.8 % likely per step at p = 0.3, where a 3-node tree still pays at batch
    8: shorter runs withheld trees that paid. A run of 16 (0.3 % at p = 0.3) withholds only
    drafts right about one time in ten or less (measurements: bench/results/gpu_decode-*).
    """

    MISSES_BEFORE_BACKOFF = 16
    FIRST_BACKOFF = 4
    MAX_BACKOFF = 32

    __slots__ = ("misses", "steps_left", "next_backoff")

    def __init__(self) -> None:
        self.misses = 0  # speculative steps in a row that accepted no draft token
        self.steps_left = 0  # decode steps still to go without a tree
        self.next_backoff = self.FIRST_BACKOFF  # the back-off after the next miss past the limit

    def grants_tree(self) -> bool:
        """Whether the sequence gets a tree at this decode step (counts a step of back-off if not).

        Asked only at steps where the batch speculates: a back-off counts engine steps, so a
        lone sequence's back-off of 4 is 4 plain windows, and its probes cost about one
        speculative step per `MAX_BACKOFF` windows once the back-off is capped.
        """
        if self.steps_left:
            self.steps_left -= 1
            return False
        return True

    def record(self, num_accepted: int) -> None:
        """The outcome of a verified tree: how many of its draft tokens were accepted."""
        if num_accepted:
            self.misses = 0
            self.next_backoff = self.FIRST_BACKOFF
            return
        self.misses += 1
        if self.misses >= self.MISSES_BEFORE_BACKOFF:
            self.steps_left = self.next_backoff
            self.next_backoff = min(2 * self.next_backoff, self.MAX_BACKOFF)
