"""Built-in agreement between a random draft and a random target (the end-to-end benchmarks).

Random weights cannot agree by chance, so the agreement is built: both models' layers have
their output projections damped (`bench.gpu_decode.stabilise_greedy`), which makes each
layer's update small beside the token embedding, and the target's embedding and LM head
carry the draft's in their first columns (zero elsewhere), so the target's greedy next token
is (mostly) the draft's. The head rows of the tokens past the ``hot_tokens`` most frequent
(the lowest ids) are scaled by ``cold_scale`` in both, so greedy tokens are mostly frequent
ones, as in text, which a draft's reduced head (FR-Spec) relies on.

The target is grafted on each tensor-parallel rank's own shard (`LLMEngine.collective_rpc`
runs `graft_draft_into_target` on every rank's runner): a rank holds its rows of the
vocabulary, and every rank's o_proj and down_proj are damped alike.
"""
from __future__ import annotations

import pathlib

import torch

from bench.gpu_decode import DAMPING, stabilise_greedy
from gpu_target.hf_checkpoint import load_tensor_slices
from gpu_target.loader import load_config, random_state_dict

DRAFT_FILE = "model.safetensors"  # the draft's weights in its directory, as the loader reads them


def draft_weights(draft_dir: str, seed: int, hot_tokens: int = 0, cold_scale: float = 1.0) -> dict[str, torch.Tensor]:
    """Random draft weights (the loader's dummy format) with its layers' outputs damped like the target's,
    and the head rows of the tokens past the ``hot_tokens`` most frequent (the lowest ids) scaled by ``cold_scale``."""
    weights = random_state_dict(load_config(draft_dir, require_weights=False), torch.bfloat16, "cpu", seed)
    for name, tensor in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor.mul_(DAMPING)
    weights["lm_head.weight"][hot_tokens:].mul_(cold_scale)
    return weights


def graft_draft_into_target(runner, draft_dir: str, head_noise: float, seed: int) -> None:
    """Give one rank's shard of the target (``runner.model``) the draft's embedding and LM head
    (read from ``draft_dir``) in its vocabulary rows, ``head_noise`` in the LM head's other
    columns (0: zeros), and damp its layers' outputs. On one GPU the shard is the whole model."""
    model = runner.model
    embed, head = model.embed_tokens.weight, model.lm_head.weight
    start, stop = model.vocab_start, model.vocab_stop
    rows = (0, start, stop)  # only this rank's rows of the draft's two tables are read
    draft = load_tensor_slices(pathlib.Path(draft_dir), {"model.embed_tokens.weight": rows, "lm_head.weight": rows},
                               embed.dtype, embed.device)
    width = draft["model.embed_tokens.weight"].shape[1]
    generator = torch.Generator(device=head.device).manual_seed(seed + start)
    with torch.no_grad():
        embed.zero_()[: stop - start, :width] = draft["model.embed_tokens.weight"]
        if head_noise:
            head.normal_(0.0, head_noise, generator=generator)
        else:
            head.zero_()
        head[: stop - start, :width] = draft["lm_head.weight"]
    stabilise_greedy(model, DAMPING)
