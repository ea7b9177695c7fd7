import json

import pytest

from lookahead import CONFIG_FILE_NAME, LookaheadConfig

# The example configuration of TACO-LLM's manual, verbatim keys and values.
MANUAL_EXAMPLE = {
    "cache_mode": 2, "cache_size": 5000000, "copy_length": 7, "match_length": 2,
    "turbo_match_length": 7, "min_match_length": 2, "cell_max_size": 16, "voc_size": 200000,
    "max_seq_len": 32768, "eos_token_id": 2, "top_k": 1, "threshold": 2.0, "decay": 0.5,
    "is_hybrid": True, "is_debug": True, "log_interval": 3000, "target_parallelism": 512,
    "top_k_in_cell": 16, "token_paths_top_k": 2, "start_freq": 10.0, "num_threads": 8,
    "global_cache_switch": True,
}


def write_config(tmp_path, values):
    (tmp_path / CONFIG_FILE_NAME).write_text(json.dumps(values))
    return tmp_path


def test_absent_file_gives_the_manuals_defaults(tmp_path):
    config = LookaheadConfig.from_dir(tmp_path)
    assert config == LookaheadConfig()
    for key, value in MANUAL_EXAMPLE.items():
        if key != "eos_token_id":  # model specific: left to the engine
            assert getattr(config, key) == value, key
    assert config.eos_token_id is None
    assert config.ignore_prompt is False and config.warmup_file is None


def test_manual_example_loads_and_absent_keys_take_defaults(tmp_path):
    assert LookaheadConfig.from_dir(write_config(tmp_path, MANUAL_EXAMPLE)).eos_token_id == 2
    config = LookaheadConfig.from_dir(write_config(tmp_path, {"cache_mode": 0, "copy_length": 4}))
    assert (config.cache_mode, config.copy_length, config.match_length) == (0, 4, 2)
    assert config.trie_depth == 2 + 4  # raw mode stores context + copy only


def test_unknown_key_names_key_and_file(tmp_path):
    write_config(tmp_path, {"cache_mode": 1, "cache_sise": 10})
    with pytest.raises(ValueError, match="cache_sise") as error:
        LookaheadConfig.from_dir(tmp_path)
    assert CONFIG_FILE_NAME in str(error.value)


@pytest.mark.parametrize(
    "values, key",
    [
        ({"copy_length": "7"}, "copy_length"),
        ({"top_k": True}, "top_k"),
        ({"is_debug": 1}, "is_debug"),
        ({"threshold": "high"}, "threshold"),
        ({"cache_mode": 3}, "cache_mode"),
        ({"cache_size": 0}, "cache_size"),
        ({"decay": 0}, "decay"),
        ({"decay": 1.5}, "decay"),
        ({"start_freq": -1.0}, "start_freq"),
        ({"min_match_length": 3, "match_length": 2}, "min_match_length"),
        ({"warmup_file": 5}, "warmup_file"),
    ],
)
def test_bad_value_names_key_and_file(tmp_path, values, key):
    write_config(tmp_path, values)
    with pytest.raises(ValueError, match=key) as error:
        LookaheadConfig.from_dir(tmp_path)
    assert CONFIG_FILE_NAME in str(error.value)


def test_invalid_json_and_non_object_are_errors(tmp_path):
    (tmp_path / CONFIG_FILE_NAME).write_text("{not json")
    with pytest.raises(ValueError, match=CONFIG_FILE_NAME):
        LookaheadConfig.from_dir(tmp_path)
    write_config(tmp_path, [1, 2])
    with pytest.raises(ValueError, match="JSON object"):
        LookaheadConfig.from_dir(tmp_path)


def test_warmup_file_is_relative_to_the_config_dir(tmp_path):
    config = LookaheadConfig.from_dir(write_config(tmp_path, {"warmup_file": "warm.json"}))
    assert config.warmup_file == str(tmp_path / "warm.json")


def test_from_ngram_is_raw_prompt_lookup():
    config = LookaheadConfig.from_ngram(num_speculative_tokens=5, prompt_lookup_max=4, prompt_lookup_min=2)
    assert config.cache_mode == 0
    assert (config.copy_length, config.match_length, config.min_match_length, config.top_k) == (5, 4, 2, 1)
    assert config.global_cache_switch is False


def test_from_ngram_bounds_default_like_vllm():
    assert LookaheadConfig.from_ngram(3).match_length == 5
    assert LookaheadConfig.from_ngram(3).min_match_length == 5
    assert LookaheadConfig.from_ngram(3, prompt_lookup_max=4).min_match_length == 4
    assert LookaheadConfig.from_ngram(3, prompt_lookup_min=2).match_length == 2


@pytest.mark.parametrize(
    "args, key",
    [((0, 3, 1), "num_speculative_tokens"), ((3, 2, 3), "prompt_lookup_min"), ((3, 0, None), "prompt_lookup_max")],
)
def test_from_ngram_rejects_bad_values(args, key):
    with pytest.raises(ValueError, match=key):
        LookaheadConfig.from_ngram(*args)
