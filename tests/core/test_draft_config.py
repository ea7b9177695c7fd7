"""The typed speculation config: speculative_config's keys onto DraftConfig, unknown keys,
environment variables as defaults only, and the lookahead settings resolved once."""
from __future__ import annotations

import dataclasses
import json

import pytest

from hetero.core.config import DRAFT_ENV_PREFIX, SPECULATIVE_CONFIG_KEYS, DraftConfig, EngineConfig
from hetero.core.lookahead_config import CONFIG_FILE_NAME, LookaheadConfig
from hetero.core.protocols import DEFAULT_TARGET_PARALLELISM, Proposer

DRAFT_ENV = [DRAFT_ENV_PREFIX + f.name.upper() for f in dataclasses.fields(DraftConfig)]


@pytest.fixture(autouse=True)
def no_draft_env(monkeypatch):
    for name in DRAFT_ENV:
        monkeypatch.delenv(name, raising=False)


def test_speculative_config_keys_map_onto_the_draft_config():
    config = EngineConfig(model="m", speculative_config={
        "model": "draft/", "num_speculative_tokens": 6, "tree_width": 2, "quantization": "int8", "cpus": "2-3",
        "threads": 2, "kv_cache_gib": 0.5, "reply_timeout_s": 3.0, "overlap": False, "dtype": "bfloat16",
        "draft_vocab_size": 1000,
    })
    assert config.speculative_model == "draft/" and config.num_speculative_tokens == 6
    assert config.draft == DraftConfig(tree_width=2, quantization="int8", cpus="2-3", threads=2, kv_cache_gib=0.5,
                                       reply_timeout_s=3.0, overlap=False, dtype="bfloat16", draft_vocab_size=1000)
    assert config.lookahead is None


def test_a_typed_draft_config_is_taken_and_speculative_config_keys_override_it():
    config = EngineConfig(model="m", speculative_model="d", draft=DraftConfig(threads=4, tree_width=3),
                          speculative_config={"threads": 2})
    assert (config.draft.threads, config.draft.tree_width) == (2, 3)
    assert dataclasses.replace(config) == config  # resolving again changes nothing
    with pytest.raises(ValueError, match="draft must be a DraftConfig"):
        EngineConfig(model="m", draft={"threads": 2})


def test_sglang_flat_draft_vocab_fields_fold_into_the_draft_config_and_the_dict_wins(tmp_path):
    token_map = tmp_path / "map.json"
    token_map.write_text("[3, 1, 2]")
    config = EngineConfig(model="m", speculative_model="d", speculative_draft_vocab_size=64, speculative_token_map=str(token_map))
    assert (config.draft.draft_vocab_size, config.draft.speculative_token_map) == (64, str(token_map))
    config = EngineConfig(model="m", speculative_model="d", speculative_draft_vocab_size=64,
                          speculative_config={"draft_vocab_size": 32})
    assert config.draft.draft_vocab_size == 32


@pytest.mark.parametrize("key, close", [("draft_threads", "threads"), ("draft_quantization", "quantization"),
                                        ("no_such_knob", None)])
def test_an_unknown_speculative_config_key_is_named_with_the_valid_ones(key, close):
    with pytest.raises(ValueError) as error:
        EngineConfig(model="m", speculative_config={"model": "d", key: 1})
    message = str(error.value)
    assert message.startswith(f"Unexpected keyword argument(s) [{key!r}] in speculative_config")
    assert ("did you mean" in message) == (close is not None)
    if close:
        assert f"did you mean {close!r} for {key!r}?" in message
    assert "valid keys are: " + ", ".join(SPECULATIVE_CONFIG_KEYS) in message


@pytest.mark.parametrize("values, named", [
    ({"tree_width": 0}, "tree_width"), ({"quantization": "int4"}, "quantization"), ({"threads": 0}, "threads"),
    ({"kv_cache_gib": 0}, "kv_cache_gib"), ({"reply_timeout_s": -1.0}, "reply_timeout_s"), ({"overlap": "yes"}, "overlap"),
    ({"dtype": "int4"}, "dtype"), ({"draft_vocab_size": 0}, "draft_vocab_size"), ({"cpus": 4}, "cpus"),
])
def test_a_bad_draft_value_names_its_key_and_variable(values, named):
    with pytest.raises(ValueError, match=rf"speculative_config\.{named}"):
        EngineConfig(model="m", speculative_config={"model": "d", **values})


def test_environment_variables_are_defaults_that_explicit_values_override(monkeypatch):
    monkeypatch.setenv("HETERO_DRAFT_THREADS", "3")
    monkeypatch.setenv("HETERO_DRAFT_CPUS", "1-2")
    monkeypatch.setenv("HETERO_DRAFT_QUANTIZATION", "none")
    monkeypatch.setenv("HETERO_DRAFT_OVERLAP", "0")
    monkeypatch.setenv("HETERO_DRAFT_TREE_WIDTH", "")  # empty: unset
    default = EngineConfig(model="m").draft
    assert (default.threads, default.cpus, default.quantization, default.overlap, default.tree_width) == (3, "1-2", None, False, 1)
    assert DraftConfig(threads=5).threads == 5
    assert EngineConfig(model="m", speculative_config={"model": "d", "threads": 6, "overlap": True}).draft.threads == 6
    monkeypatch.setenv("HETERO_DRAFT_THREADS", "many")
    with pytest.raises(ValueError, match="HETERO_DRAFT_THREADS has a bad value 'many'"):
        DraftConfig()


def test_every_env_backed_field_is_documented_with_its_variable():
    documented = DraftConfig.__doc__
    assert "$HETERO_DRAFT_<FIELD>" in documented
    env_backed = [f.name for f in dataclasses.fields(DraftConfig) if f.default_factory is not dataclasses.MISSING]
    assert env_backed == ["tree_width", "quantization", "cpus", "threads", "kv_cache_gib", "reply_timeout_s", "overlap", "dtype"]


def test_ngram_speculative_config_resolves_to_a_lookahead_config():
    config = EngineConfig(model="m", speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3},
                          ignore_prompt_for_lookahead_cache=True)
    expected = dataclasses.replace(LookaheadConfig.from_ngram(4, prompt_lookup_max=3), ignore_prompt=True)
    assert config.lookahead == expected
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        EngineConfig(model="m", speculative_config={"method": "ngram", "prompt_lookup_max": 2, "prompt_lookup_min": 3})


def test_lookahead_config_dir_is_read_into_the_config(tmp_path):
    (tmp_path / CONFIG_FILE_NAME).write_text(json.dumps({"copy_length": 5, "is_debug": False}))
    config = EngineConfig(model="m", lookahead_cache_config_dir=str(tmp_path))
    assert config.lookahead.copy_length == 5 and not config.lookahead.is_debug
    given = LookaheadConfig(copy_length=3)
    assert EngineConfig(model="m", lookahead=given, lookahead_cache_config_dir=str(tmp_path)).lookahead == given
    assert EngineConfig(model="m").lookahead is None


def test_llm_kwargs_reject_the_removed_extra_dict():
    with pytest.raises(TypeError, match="extra"):
        EngineConfig.from_kwargs("m", extra={"draft_threads": 2})


class _Budgeted(Proposer):
    def propose(self, batch):
        return []

    def commit(self, verdicts):
        pass

    def release(self, request_id):
        pass


@pytest.mark.parametrize("budget", [None, 8])
def test_the_engine_takes_its_node_budget_from_the_proposer(tiny_llama_dir, budget):
    from hetero.engine import LLMEngine

    proposer = _Budgeted()
    if budget is not None:
        proposer.target_parallelism = budget
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32", max_model_len=128), proposer)
    assert engine.spec_control.target_parallelism == (budget or DEFAULT_TARGET_PARALLELISM)
    assert proposer.close() is None  # the protocol's default: nothing to stop
