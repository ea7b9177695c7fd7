"""Appending tokens without per-token work (`OutputProcessor._append_unwatched`) against checking
every token for a stop."""
import random

import pytest
import torch

from gpu_target.kv_cache import BlockAllocator
from hetero.core.sampling_params import SamplingParams
from hetero.output_processor import OutputProcessor
from hetero.scheduler import Scheduler, Sequence, SequenceGroup

EOS = (2,)


def _seq(params: SamplingParams, max_tokens: int) -> Sequence:
    group = SequenceGroup("r", None, [5, 6, 7], params, max_tokens, 0.0)
    seq = Sequence(group, 0, torch.Generator())
    group.seqs.append(seq)
    return seq


def _every_token(processor: OutputProcessor, seq: Sequence, new_tokens: list[int]) -> bool:
    for token in new_tokens:
        seq.token_ids.append(token)
        processor.num_generation_tokens += 1
        if processor._check_stop(seq, token):
            return True
    return False


@pytest.mark.parametrize("seed", range(20))
def test_appending_runs_of_tokens_stops_where_checking_each_token_does(seed):
    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=50, stop_token_ids=rng.sample(range(8), rng.randint(0, 2)),
                            ignore_eos=rng.random() < 0.3, min_tokens=rng.randint(0, 6), detokenize=False)
    max_tokens, max_model_len = rng.randint(1, 30), rng.randint(8, 40)
    processors = [OutputProcessor(None, EOS, max_model_len, Scheduler(BlockAllocator(64, 4), 4, 64)) for _ in range(2)]
    seqs = [_seq(params, max_tokens) for _ in range(2)]
    for _ in range(20):
        new_tokens = [rng.randrange(10) for _ in range(rng.randint(1, 8))]
        stopped = processors[0]._append_unwatched(seqs[0], new_tokens)
        assert stopped == _every_token(processors[1], seqs[1], new_tokens)
        assert seqs[0].token_ids == seqs[1].token_ids
        assert (seqs[0].finish_reason, seqs[0].stop_reason) == (seqs[1].finish_reason, seqs[1].stop_reason)
        assert processors[0].num_generation_tokens == processors[1].num_generation_tokens
        if stopped:
            break


@pytest.mark.parametrize("params, unwatched", [
    (SamplingParams(temperature=0.0), True),
    (SamplingParams(temperature=0.0, stop_token_ids=[3], ignore_eos=True), True),  # stops by token: checked in the run
    (SamplingParams(temperature=0.0, logprobs=0), False),
    (SamplingParams(temperature=1.0, n=1, best_of=2), False),  # ranked by cumulative logprob
    (SamplingParams(temperature=0.0, stop=["x"]), False),  # stop strings need the text as it grows
])
def test_which_requests_append_runs_without_per_token_work(params, unwatched):
    assert _seq(params, 10).group.appends_unwatched is unwatched
