"""The offline API, as vLLM's `LLM`: construct once, then `generate` or `chat`."""
from __future__ import annotations

import copy
import itertools
from typing import Any, Callable, Optional, Sequence, Union

from tqdm.auto import tqdm

from hetero.core.config import EngineConfig
from hetero.engine import LLMEngine
from hetero.outputs import RequestOutput
from hetero.core.sampling_params import RequestOutputKind, SamplingParams

PromptType = Union[str, dict[str, Any]]


class LLM:
    """An engine for offline batched generation.

    Takes vLLM's constructor arguments (model, tokenizer, dtype, seed, max_model_len,
    max_num_seqs, max_num_batched_tokens, gpu_memory_utilization, enforce_eager,
    trust_remote_code, tensor_parallel_size, enable_prefix_caching, ...) and the
    speculation arguments of vLLM and TACO-LLM (speculative_model,
    num_speculative_tokens, speculative_config, cpu_draft_worker,
    lookahead_cache_config_dir, ...). Unknown arguments are a TypeError.
    """

    def __init__(self, model: str, **kwargs: Any):
        config = EngineConfig.from_kwargs(model, **kwargs)
        self.llm_engine = LLMEngine(config)
        self.llm_engine.waits_for_all = True  # `generate` returns once every prompt is done
        self._request_counter = itertools.count()

    def collective_rpc(self, method: Union[str, Callable[..., Any]], timeout: Optional[float] = None, args: tuple = (),
                       kwargs: Optional[dict] = None) -> list:
        """vLLM's: ``method`` on every tensor-parallel rank's model runner (`LLMEngine.collective_rpc`)."""
        return self.llm_engine.collective_rpc(method, timeout, args, kwargs)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use when given no sampling parameters, as vLLM's: the
        model's generation_config.json defaults (`generation_config`) with
        `override_generation_config` over them, else SamplingParams()'s."""
        return SamplingParams(**self.llm_engine.default_sampling_fields)

    def generate(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate completions for every prompt; outputs come back in prompt order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        params_list = self._per_prompt_params(sampling_params, len(prompts))
        request_ids = []
        try:
            for prompt, params in zip(prompts, params_list):
                request_id = str(next(self._request_counter))
                self.llm_engine.add_request(request_id, prompt, params)
                request_ids.append(request_id)
        except Exception:
            for request_id in request_ids:
                self.llm_engine.abort_request(request_id)
            raise
        return self._run_engine(request_ids, use_tqdm)

    def chat(
        self,
        messages: Union[list[dict[str, Any]], list[list[dict[str, Any]]]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: bool = True,
        chat_template: Optional[str] = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [
            render_chat_prompt(
                self.get_tokenizer(), conversation, chat_template, add_generation_prompt, continue_final_message
            )
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _per_prompt_params(self, sampling_params, count: int) -> list[SamplingParams]:
        """One SamplingParams per prompt, each a copy asking for the final output only, as vLLM's LLM does."""
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            return [_final_only(sampling_params)] * count
        params = list(sampling_params)
        if len(params) != count:
            raise ValueError(f"got {len(params)} sampling_params for {count} prompts; pass one or one per prompt")
        finals: dict[int, SamplingParams] = {}
        for item in params:
            if not isinstance(item, SamplingParams):
                raise ValueError(f"sampling_params must be SamplingParams, got {type(item).__name__}")
            if id(item) not in finals:
                finals[id(item)] = _final_only(item)
        return [finals[id(item)] for item in params]

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        prompt_tokens = output_tokens = 0
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        prompt_tokens += len(output.prompt_token_ids)
                        output_tokens += sum(len(o.token_ids) for o in output.outputs)
                        elapsed = bar.format_dict["elapsed"] or 1e-9
                        bar.set_postfix_str(
                            f"est. speed input: {prompt_tokens / elapsed:.2f} toks/s, output: {output_tokens / elapsed:.2f} toks/s"
                        )
                        bar.update(1)
        except BaseException:
            # Ctrl-C or an engine error: leave nothing of this call behind for the next one.
            for request_id in request_ids:
                engine.abort_request(request_id)
            raise
        finally:
            bar.close()
        return [finished[request_id] for request_id in request_ids]


def _final_only(params: SamplingParams) -> SamplingParams:
    """A copy of `params` whose request reports only its finished output (the caller's object is left as it was)."""
    final = copy.copy(params)
    final.output_kind = RequestOutputKind.FINAL_ONLY
    return final


def render_chat_prompt(
    tokenizer, conversation, chat_template, add_generation_prompt, continue_final_message,
    tools=None, template_kwargs=None, add_special_tokens=False,
) -> dict[str, Any]:
    """Apply the chat template; the template carries its own special tokens, so none are added
    unless `add_special_tokens` (vLLM's request field). `tools` and `template_kwargs` (vLLM's
    `chat_template_kwargs`) are passed to the template."""
    if tokenizer.chat_template is None and chat_template is None:
        raise ValueError("the tokenizer has no chat template; pass chat_template=")
    text = tokenizer.apply_chat_template(
        conversation,
        chat_template=chat_template,
        tokenize=False,
        add_generation_prompt=add_generation_prompt and not continue_final_message,
        continue_final_message=continue_final_message,
        tools=tools,
        **(template_kwargs or {}),
    )
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=add_special_tokens)}
