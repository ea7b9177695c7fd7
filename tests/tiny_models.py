"""Tiny random-initialised models saved as real HF directories (config, safetensors, tokenizer)."""
from __future__ import annotations

import pathlib

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# Prompts the engine tests decode (mixed lengths, one of a single token).
PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "def add(a, b):",
    "Once upon a time there was a small model that generated text. Speculative",
    "x",
    "The capital of Italy is Rome. The capital of",
    "Speculative decoding drafts tokens on the CPU",
    "Hello",
]

_CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Hello, my name is Ada and I like to write code in Python.",
    "def add(a, b):\n    return a + b\n",
    "Once upon a time there was a small model that generated text.",
    "Speculative decoding drafts tokens on the CPU and verifies them on the GPU.",
] * 20

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(vocab_size: int = 320) -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE trained on a tiny corpus: real merges, real decoding, small vocabulary."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(_CORPUS, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tiny_model(path: pathlib.Path, architecture: str = "llama", seed: int = 0, **overrides) -> pathlib.Path:
    """Build, randomly initialise and save a tiny model of `architecture` ("llama" or "qwen2")."""
    tokenizer = build_tokenizer()
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    if architecture == "llama":
        config = transformers.LlamaConfig(**common)
        model_cls = transformers.LlamaForCausalLM
    elif architecture == "qwen2":
        config = transformers.Qwen2Config(**common)
        model_cls = transformers.Qwen2ForCausalLM
    else:
        raise ValueError(architecture)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    # Random init of this size gives near-uniform logits; scale up so greedy argmax has margins.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.08 if "embed" in name or "lm_head" in name else 0.05)
            if name.endswith("bias"):
                param.normal_(0.0, 0.02)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
