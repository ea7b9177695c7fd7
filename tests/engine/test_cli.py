"""`hetero serve`: flags from one table, --config as vLLM reads it, errors, SIGTERM."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import threading

import httpx
import pytest

from hetero.cli import FLAGS, engine_config_from_args, main, parse_serve_args
from hetero.core.config import EngineConfig
from server_helpers import LOOPBACK, free_port, wait_until

HETERO = shutil.which("hetero", path=os.path.dirname(sys.executable))


def test_every_engine_config_field_has_exactly_one_flag():
    fields = {f.name for f in dataclasses.fields(EngineConfig)} - {"model", "draft", "lookahead"}  # typed: no flags
    engine_flags = [f.name for f in FLAGS if f.engine]
    assert sorted(engine_flags) == sorted(fields)
    assert len({f.option for f in FLAGS}) == len(FLAGS)


def test_help_documents_every_flag():
    assert HETERO, "the `hetero` console script is not installed in this venv"
    result = subprocess.run([HETERO, "serve", "-h"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    for flag in FLAGS:
        assert flag.option in result.stdout
    assert "--config" in result.stdout


def test_defaults_come_from_engine_config_and_flags_reach_it():
    args = parse_serve_args(["serve", "m"])
    assert engine_config_from_args(args) == EngineConfig(model="m")
    args = parse_serve_args([
        "serve", "m", "--max-model-len", "512", "--enable-prefix-caching", "--dtype", "float32",
        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}', "--cpu-draft-worker",
        "--lookahead-cache-config-dir", "/tmp/la", "--kv-cache-space", "2.5", "--kv-cache-memory-bytes", "1073741824",
    ])
    config = engine_config_from_args(args)
    assert (config.max_model_len, config.enable_prefix_caching, config.dtype) == (512, True, "float32")
    assert config.speculative_config == {"method": "ngram", "num_speculative_tokens": 4}
    assert config.num_speculative_tokens == 4 and config.cpu_draft_worker and config.kv_cache_space == 2.5
    assert config.lookahead_cache_config_dir == "/tmp/la" and config.kv_cache_memory_bytes == 2**30


def test_vllms_flags_that_change_nothing_here_are_accepted_and_the_others_named():
    args = parse_serve_args([
        "serve", "m", "--enable-chunked-prefill", "--disable-log-requests", "--disable-log-stats",
        "--kv-cache-dtype", "auto", "--swap-space", "4", "--max-seq-len-to-capture", "8192", "--pipeline-parallel-size", "1",
        "--disable-cascade-attn", "--max-num-partial-prefills", "1", "--max-long-partial-prefills", "1",
        "--long-prefill-token-threshold", "0", "--disable-sliding-window", "--no-enable-prompt-embeds", "--model-impl", "auto",
        "--config-format", "hf", "--max-parallel-loading-workers", "2", "--num-lookahead-slots", "4", "--worker-cls", "auto",
        "--no-enable-expert-parallel", "--guided-decoding-backend", "xgrammar",
    ])
    assert engine_config_from_args(args) == EngineConfig(model="m")
    for argv, name in [(["--kv-cache-dtype", "fp8"], "kv_cache_dtype"), (["--pipeline-parallel-size", "2"], "pipeline_parallel_size"),
                       (["--revision", "main"], "revision"), (["--enable-lora"], "enable_lora"),
                       (["--max-num-partial-prefills", "4"], "max_num_partial_prefills"),
                       (["--long-prefill-token-threshold", "512"], "long_prefill_token_threshold"),
                       (["--enable-prompt-embeds"], "enable_prompt_embeds"), (["--model-impl", "transformers"], "model_impl"),
                       (["--config-format", "mistral"], "config_format"),
                       (["--max-parallel-loading-workers", "0"], "max_parallel_loading_workers"),
                       (["--num-lookahead-slots", "-1"], "num_lookahead_slots"), (["--worker-cls", "my.Worker"], "worker_cls"),
                       (["--enable-expert-parallel"], "enable_expert_parallel"),
                       (["--guided-decoding-backend", "lm-format-enforcer"], "guided_decoding_backend")]:
        with pytest.raises(ValueError, match=f"{name}=.* is not supported"):
            engine_config_from_args(parse_serve_args(["serve", "m", *argv]))



def test_hf_overrides_is_json_on_the_command_line_and_a_mapping_in_config_files(tmp_path, tiny_llama_dir, capsys):
    args = parse_serve_args(["serve", "m", "--hf-overrides", '{"max_position_embeddings": 4096, "rope_theta": 1e6}'])
    assert engine_config_from_args(args).hf_overrides == {"max_position_embeddings": 4096, "rope_theta": 1e6}
    path = tmp_path / "serve.yaml"
    path.write_text("hf-overrides:\n  max_position_embeddings: 4096\n")
    assert engine_config_from_args(parse_serve_args(["serve", "m", "--config", str(path)])).hf_overrides == {
        "max_position_embeddings": 4096}
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", str(tiny_llama_dir), "--hf-overrides", '{"max_position_embeddings": "long"}'])
    assert exit_info.value.code == 2
    assert "hf_overrides['max_position_embeddings']" in capsys.readouterr().err


def test_override_generation_config_is_json_on_the_command_line_and_reaches_the_engines_defaults(
        tmp_path, tiny_llama_dir, capsys):
    from hetero.engine import LLMEngine

    argv = ["serve", str(tiny_llama_dir), "--device", "cpu", "--generation-config", "vllm",
            "--override-generation-config", '{"temperature": 0.5, "max_new_tokens": 3}']
    engine = LLMEngine(engine_config_from_args(parse_serve_args(argv)))
    assert engine.default_sampling_fields == {"temperature": 0.5, "max_tokens": 3}
    path = tmp_path / "serve.yaml"
    path.write_text("override-generation-config:\n  top_k: 20\n")
    assert engine_config_from_args(parse_serve_args(["serve", "m", "--config", str(path)])).override_generation_config == {
        "top_k": 20}
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "m", "--override-generation-config", '{"do_sample": true}'])
    assert exit_info.value.code == 2
    assert "override_generation_config['do_sample']" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["serve", "m", "--no-such-flag"],
    ["serve", "m", "--max-model"],  # abbreviations are not accepted
    ["serve", "m", "--max-num-seqs", "many"],
    ["serve", "m", "--kv-cache-memory-bytes", "1.5e9"],  # an int, as vLLM's
    ["serve", "m", "--speculative-config", "{not json"],
    ["serve", "m", "--hf-overrides", '["max_position_embeddings"]'],  # a JSON object, not a list
    ["serve", "m", "--override-generation-config", "0.5"],  # a JSON object, as vLLM's
    ["serve"],  # no model
])
def test_bad_command_lines_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_serve_args(argv)
    assert exit_info.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_bad_engine_values_exit_with_the_field_named(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "m", "--max-num-seqs", "0"])
    assert exit_info.value.code == 2
    assert "max_num_seqs" in capsys.readouterr().err


def test_config_file_is_read_like_vllm_and_the_command_line_wins(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text(
        "model: /models/m\nport: 9001\nmax-model-len: 1024\nmax_num_seqs: 8\nenable-prefix-caching: true\n"
        "enforce-eager: false\nserved-model-name: [a, b]\nspeculative-config:\n  method: ngram\n"
        "  num_speculative_tokens: 3\n"
    )
    args = parse_serve_args(["serve", "--config", str(path), "--port", "9002"])
    assert args.model == "/models/m" and args.port == 9002 and args.served_model_name == ["a", "b"]
    config = engine_config_from_args(args)
    assert (config.max_model_len, config.max_num_seqs, config.enable_prefix_caching) == (1024, 8, True)
    assert config.num_speculative_tokens == 3
    assert parse_serve_args(["serve", "other", "--config", str(path)]).model == "other"


def test_a_list_valued_config_key_does_not_swallow_the_model(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("served-model-name: [x]\n")
    args = parse_serve_args(["serve", "MYMODEL", "--config", str(path)])
    assert (args.model, args.served_model_name) == ("MYMODEL", ["x"])
    args = parse_serve_args(["serve", "MYMODEL", "--config", str(path), "--served-model-name", "y"])
    assert (args.model, args.served_model_name) == ("MYMODEL", ["y"])


@pytest.mark.parametrize("content, message", [
    ("bogus-key: 1\n", "bogus-key"),
    ("enable-prefix-caching: maybe\n", "enable_prefix_caching"),
    ("- a list\n", "mapping"),
    ("port: [unclosed\n", "YAML"),
])
def test_bad_config_files_are_usage_errors(tmp_path, capsys, content, message):
    path = tmp_path / "serve.yaml"
    path.write_text(content)
    with pytest.raises(SystemExit):
        parse_serve_args(["serve", "m", "--config", str(path)])
    assert message in capsys.readouterr().err


def test_sigterm_lets_an_in_flight_stream_finish_then_exits(tiny_llama_dir):
    port = free_port()
    base = f"http://{LOOPBACK}:{port}"
    process = subprocess.Popen(
        [HETERO, "serve", str(tiny_llama_dir), "--host", LOOPBACK, "--port", str(port), "--dtype", "float32",
         "--max-model-len", "512", "--served-model-name", "tiny", "--uvicorn-log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        def healthy() -> bool:
            try:
                return httpx.get(base + "/health", timeout=1).status_code == 200
            except httpx.TransportError:
                return process.poll() is not None

        assert wait_until(healthy, timeout=60) and process.poll() is None, "the server did not come up"
        lines: list[str] = []
        first_event = threading.Event()

        def stream() -> None:
            body = {"model": "tiny", "prompt": "Hello", "max_tokens": 500, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    if line:
                        lines.append(line)
                        first_event.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first_event.wait(30)
        process.send_signal(signal.SIGTERM)
        lines_at_signal = len(lines)
        reader.join(60)
        # uvicorn re-raises the captured SIGTERM once it has shut down gracefully.
        assert process.wait(60) in (0, -signal.SIGTERM)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert lines[-1] == "data: [DONE]"
    assert len(lines) > lines_at_signal + 1, "the stream should have gone on after SIGTERM"
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(len(e["choices"][0]["text"]) for e in events) > 0
    with pytest.raises(httpx.TransportError):
        httpx.get(base + "/health", timeout=2)
