"""From new tokens to `RequestOutput`s: appending, stop conditions, logprobs, incremental text.

A sequence takes its new tokens one at a time up to the first stop (a stop token, EOS,
a stop string in the incrementally decoded text, max_tokens or max_model_len), as vLLM's
output processor does; tokens after a stop (the rest of an accepted draft path) are dropped.

Appending (`append_tokens`) decides what the next step schedules; rendering
(`request_outputs`: the text and the `RequestOutput`s) decides nothing, so the engine may run
it while the device computes the next step (async scheduling). A sequence with stop strings
is detokenised as it appends, since its text decides whether it stops; every other one's text
is caught up token by token when it is rendered, which gives the same text.
"""
from __future__ import annotations

from typing import Optional, Sequence as Seq

import torch

from gpu_target.sampler import raw_logprobs
from hetero.core.sampling_params import RequestOutputKind
from hetero.detokenizer import catch_up, decode_new_text, find_stop_string
from hetero.outputs import CompletionOutput, Logprob, RequestOutput
from hetero.scheduler import Scheduler, Sequence, SequenceGroup


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: tuple[int, ...], max_model_len: int, scheduler: Scheduler):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self._eos_set = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.scheduler = scheduler
        self.num_generation_tokens = 0

    def append_tokens(
        self, seq: Sequence, new_tokens: list[int], logits: Optional[torch.Tensor], token_rows: Seq[int], now: float
    ) -> bool:
        """Append tokens up to the first stop; whether the sequence stopped.

        `logits` rows `token_rows` score the tokens; they are read only for logprobs. `now`
        is the step's time, for the request's token timestamps. A stopped sequence has its
        finish_reason set and its filled blocks registered in the prefix cache; the caller
        finishes it. A sequence that goes on has its blocks registered by the caller
        (`Scheduler.register_blocks`), which can do it after launching the next step.
        """
        group = seq.group
        metrics = group.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.last_token_time = now
        if group.appends_unwatched and seq.grammar is None:
            if self._append_unwatched(seq, new_tokens):
                self.scheduler.register_blocks(seq)
                return True
            return False
        params = seq.params
        want = params.logprobs
        ranks_samples = (params.best_of or params.n) > params.n  # best_of picks by cumulative logprob
        if want is not None or ranks_samples:
            chosen = torch.tensor(new_tokens, device=logits.device)
            token_logprobs = raw_logprobs(logits[token_rows], chosen, [want or 0] * len(new_tokens))
        for i, token in enumerate(new_tokens):
            seq.token_ids.append(token)
            if seq.grammar is not None:
                seq.grammar.accept(token)
            self.num_generation_tokens += 1
            if want is not None or ranks_samples:
                seq.cumulative_logprob += token_logprobs[i][token][0]
            if want is not None:
                seq.logprobs.append(self.logprob_entry(token_logprobs[i]))
            if self._check_stop(seq, token):
                self.scheduler.register_blocks(seq)
                return True
        return False

    def _append_unwatched(self, seq: Sequence, new_tokens: list[int]) -> bool:
        """Append tokens that need no work of their own (no logprobs, grammar or stop strings) up
        to the first stop; whether the sequence stopped.

        Only a stop token, EOS or a length limit can stop such a sequence, so `_check_stop` is
        asked at those tokens alone and the rest are appended a run at a time.
        """
        params, group = seq.params, seq.group
        length = len(seq.token_ids)
        length_left = min(group.max_tokens - (length - seq.num_prompt_tokens), self.max_model_len - length)
        if (len(new_tokens) < length_left and group.stop_token_set.isdisjoint(new_tokens)
                and (params.ignore_eos or self._eos_set.isdisjoint(new_tokens))):
            seq.token_ids.extend(new_tokens)  # no token can stop it: one run
            self.num_generation_tokens += len(new_tokens)
            return False
        stop_ids = params.stop_token_ids or ()
        eos = () if params.ignore_eos else self.eos_token_ids
        appended = 0
        for i, token in enumerate(new_tokens):
            if i + 1 >= length_left or token in stop_ids or token in eos:
                seq.token_ids.extend(new_tokens[appended : i + 1])
                self.num_generation_tokens += i + 1 - appended
                appended = i + 1
                if self._check_stop(seq, token):
                    return True
        seq.token_ids.extend(new_tokens[appended:])
        self.num_generation_tokens += len(new_tokens) - appended
        return False

    def _check_stop(self, seq: Sequence, token: int) -> bool:
        params = seq.params
        num_output = seq.num_output_tokens
        if params.detokenize and params.stop:
            new_text = decode_new_text(
                self.tokenizer, seq.token_ids, seq.detok, params.skip_special_tokens, params.spaces_between_special_tokens
            )
        else:
            new_text = ""
        if num_output >= params.min_tokens:
            if token in (params.stop_token_ids or ()):
                seq.finish_reason, seq.stop_reason = "stop", token
                return True
            if not params.ignore_eos and token in self.eos_token_ids:
                seq.finish_reason = "stop"
                return True
            if new_text and params.stop:
                hit = find_stop_string(seq.detok.text, len(new_text), params.stop, params.include_stop_str_in_output)
                if hit is not None:
                    seq.detok.text = seq.detok.text[: hit[1]]
                    seq.finish_reason, seq.stop_reason = "stop", hit[0]
                    return True
        if num_output >= seq.group.max_tokens or len(seq.token_ids) >= self.max_model_len:
            seq.finish_reason = "length"
            return True
        return False

    def record_prompt_logprobs(self, seq: Sequence, logits: torch.Tensor) -> None:
        """Score the prompt tokens these logits rows predict (prompt_logprobs), after those already scored."""
        group = seq.group
        start = len(group.prompt_logprobs)  # the first prompt position not scored yet
        targets = torch.tensor(seq.token_ids[start : start + logits.shape[0]], device=logits.device)
        top = seq.params.prompt_logprobs
        for entry in raw_logprobs(logits, targets, [top] * logits.shape[0]):
            group.prompt_logprobs.append(self.logprob_entry(entry))

    def logprob_entry(self, entry: dict[int, tuple[float, int]]) -> dict[int, Logprob]:
        decode = (lambda t: None) if self.tokenizer is None else (lambda t: self.tokenizer.decode([t]))
        return {t: Logprob(lp, rank, decode(t)) for t, (lp, rank) in entry.items()}

    def request_outputs(self, touched: list[SequenceGroup]) -> list[RequestOutput]:
        """The text of the groups a step touched, and their outputs, except unfinished FINAL_ONLY ones."""
        for group in touched:
            if group.params.detokenize:
                for seq in group.seqs:
                    catch_up(self.tokenizer, seq.token_ids, seq.detok, group.params.skip_special_tokens,
                             group.params.spaces_between_special_tokens)
        return [
            request_output(group)
            for group in touched
            if group.is_finished or group.params.output_kind is not RequestOutputKind.FINAL_ONLY
        ]


def request_output(group: SequenceGroup) -> RequestOutput:
    """The request's output so far; best_of ranks its samples by cumulative logprob once all are done."""
    params = group.params
    finished = group.is_finished
    seqs = group.seqs
    if (params.best_of or params.n) > params.n:
        if not finished:
            seqs = []
        else:
            seqs = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[: params.n]
    outputs = [
        CompletionOutput(
            index=i if (params.best_of or params.n) > params.n else seq.index,
            text=seq.detok.text,
            token_ids=seq.output_token_ids,
            cumulative_logprob=seq.cumulative_logprob if params.logprobs is not None else None,
            logprobs=list(seq.logprobs) if params.logprobs is not None else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )
        for i, seq in enumerate(seqs)
    ]
    metrics = group.metrics
    metrics.num_draft_tokens = sum(s.spec.num_draft_tokens for s in group.seqs)
    metrics.num_accepted_tokens = sum(s.spec.num_accepted_tokens for s in group.seqs)
    metrics.num_spec_steps = sum(s.spec.num_steps for s in group.seqs)
    return RequestOutput(
        request_id=group.request_id,
        prompt=group.prompt,
        prompt_token_ids=group.prompt_token_ids,
        prompt_logprobs=group.prompt_logprobs,
        outputs=outputs,
        finished=finished,
        metrics=metrics,
        num_cached_tokens=group.num_cached_tokens,
    )
