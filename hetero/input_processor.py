"""From a request to a `SequenceGroup`: tokenising, validation, grammars and generators.

Everything about a request that can be wrong is found here, before anything is scheduled,
and reported as a ValueError naming the field (vLLM's `InputProcessor` plays this part).
"""
from __future__ import annotations

import time
from typing import Any, Optional

import torch

from gpu_target.model_config import ModelConfig
from hetero.core.sampling_params import SamplingParams, logprobs_over_cap
from hetero.scheduler import Sequence, SequenceGroup


class InputProcessor:
    def __init__(self, tokenizer, model_config: ModelConfig, max_model_len: int, device: torch.device, max_logprobs: int = -1):
        self.tokenizer = tokenizer
        self.vocab_size = model_config.vocab_size
        self.max_model_len = max_model_len
        self.max_logprobs = max_logprobs  # -1: no cap
        self.device = device
        self.eos_token_ids = eos_token_ids(model_config, tokenizer)
        self._grammar_compiler = None  # built at the first request with structured_outputs

    def new_group(self, request_id: str, prompt: Any, params: SamplingParams, arrival_time: Optional[float]) -> SequenceGroup:
        """The request's group with its n (or best_of) sequences, each with its grammar state and generator."""
        if self.tokenizer is None and (params.detokenize or params.stop):
            raise ValueError("detokenize and stop strings need a tokenizer; skip_tokenizer_init=True is set")
        text, token_ids = self.tokenize(prompt)
        self._validate_prompt(token_ids)
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(token_ids)
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt ({len(token_ids)} tokens) is longer than max_model_len ({self.max_model_len}) "
                "minus the one token it must leave room to generate"
            )
        self._validate_logit_bias(params)
        self._validate_logprobs(params)
        num_seqs = max(params.n, params.best_of or params.n)
        grammars = self._grammar_states(params, num_seqs)
        group = SequenceGroup(request_id, text, token_ids, params, max_tokens, arrival_time or time.time())
        for index in range(num_seqs):
            seq = Sequence(group, index, self._generator(params.seed, index))
            seq.grammar = grammars[index] if grammars else None
            group.seqs.append(seq)
        return group

    def tokenize(self, prompt: Any) -> tuple[Optional[str], list[int]]:
        """`prompt`: a string, or a dict with "prompt_token_ids" (and optionally "prompt"), or with "prompt"."""
        if isinstance(prompt, str) and self.tokenizer is None:
            raise ValueError("text prompts need a tokenizer; with skip_tokenizer_init=True pass {'prompt_token_ids': [...]}")
        if isinstance(prompt, str):
            return prompt, list(self.tokenizer(prompt).input_ids)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) for t in ids):
                raise ValueError("prompt_token_ids must be a list of ints")
            return prompt.get("prompt"), list(ids)
        if isinstance(prompt, dict) and "prompt" in prompt:
            return self.tokenize(prompt["prompt"])
        raise ValueError(f"a prompt must be a string or a dict with 'prompt_token_ids', got {type(prompt).__name__}")

    def _validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is out of the vocabulary range [0, {self.vocab_size})")

    def _validate_logprobs(self, params: SamplingParams) -> None:
        """logprobs and prompt_logprobs within `max_logprobs` (vLLM's check; -1 asks for the whole vocabulary)."""
        for name in ("logprobs", "prompt_logprobs"):
            requested = logprobs_over_cap(getattr(params, name), self.max_logprobs, self.vocab_size)
            if requested is not None:
                raise ValueError(f"{name}: requested {requested} logprobs, more than max_logprobs={self.max_logprobs}")

    def _validate_logit_bias(self, params: SamplingParams) -> None:
        bad = [t for t in params.logit_bias or () if t >= self.vocab_size]
        if bad:
            raise ValueError(f"logit_bias token id {bad[0]} is out of the vocabulary range [0, {self.vocab_size})")

    def _grammar_states(self, params: SamplingParams, count: int) -> list:
        """A fresh grammar state for each of the request's sequences ([] without structured_outputs).

        The grammar is compiled here, so a bad one is a ValueError before anything is scheduled.
        """
        spec = params.structured_outputs
        if spec is None:
            return []
        if self.tokenizer is None:
            raise ValueError("structured_outputs needs a tokenizer; skip_tokenizer_init=True is set")
        if self._grammar_compiler is None:
            from hetero.structured_output import GrammarCompiler

            self._grammar_compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._grammar_compiler.new_states(spec, count)

    def _generator(self, seed: Optional[int], index: int) -> Optional[torch.Generator]:
        """A seeded request's own generator, so it samples the same whatever the batch.

        Unseeded requests share the default generator (seeded from the engine's `seed`),
        which lets their rows be sampled in one batched call.
        """
        if seed is None:
            return None
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed if index == 0 else hash((seed, index)) & (2**63 - 1))
        return generator


def eos_token_ids(model_config: ModelConfig, tokenizer) -> tuple[int, ...]:
    """The model's EOS ids and the tokenizer's, sorted."""
    ids = set(model_config.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))
