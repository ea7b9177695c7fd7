"""`hetero serve MODEL [options]`: vLLM's and TACO-LLM's server flags, or a YAML `--config`.

Every flag comes from one table, `FLAGS`. An engine flag is named after its
`EngineConfig` field and takes that field's default, so the CLI and the engine cannot
drift apart (a test checks that every field has a flag). `--config file.yaml` works as
in vLLM: keys are flag names, and flags given on the command line override the file.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import yaml

from hetero import __version__
from hetero.core.config import QUANTIZATION_METHODS, SPECULATIVE_CONFIG_KEYS, EngineConfig
from hetero.core.sampling_params import GENERATION_CONFIG_FIELDS
from hetero.core.vllm_args import NEUTRAL_ARGS, NEUTRAL_BY_NAME

_NO_DEFAULT = object()
_UVICORN_LOG_LEVELS = ["critical", "error", "warning", "info", "debug", "trace"]


def json_object(text: str) -> dict[str, Any]:
    """argparse type for a JSON object given inline (as vLLM's --speculative-config)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc}): {text!r}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


@dataclass(frozen=True)
class Flag:
    """One command-line option. `type=None` makes a --flag/--no-flag boolean."""

    name: str  # the argparse dest; for engine flags, the EngineConfig field
    help: str
    type: Optional[Callable[[str], Any]] = str
    engine: bool = True
    default: Any = _NO_DEFAULT  # server flags only: engine flags take EngineConfig's
    nargs: Optional[str] = None
    choices: Optional[Sequence[str]] = None

    @property
    def option(self) -> str:
        return "--" + self.name.replace("_", "-")


FLAGS: tuple[Flag, ...] = (
    # --- the HTTP server
    Flag("host", "Address to listen on.", engine=False, default="0.0.0.0"),
    Flag("port", "Port to listen on.", int, engine=False, default=8000),
    Flag("api_key", "Bearer key required on /v1/*, /tokenize and /detokenize; with one, /docs and /openapi.json "
         "are off (default: $HETERO_API_KEY; none = open).", engine=False, default=None),
    Flag("served_model_name", "Model name(s) the API answers to (default: the model argument).", engine=False,
         default=None, nargs="+"),
    Flag("max_seqs_per_request", "Most sequences (n, best_of) one request may ask for (default: --max-num-seqs).",
         int, engine=False, default=None),
    Flag("max_request_body_bytes", "Largest request body; bigger ones get 413 before they are read "
         "(default: 16 MiB).", int, engine=False, default=None),
    Flag("chat_template", "Chat template file or inline Jinja text (default: the tokenizer's).", engine=False,
         default=None),
    Flag("uvicorn_log_level", "uvicorn's log level.", engine=False, default="info", choices=_UVICORN_LOG_LEVELS),
    Flag("shutdown_timeout", "Seconds in-flight requests get to finish on SIGTERM before they are aborted.",
         float, engine=False, default=30.0),
    Flag("enable_auto_tool_choice", "Parse the model's own tool calls (tool_choice \"auto\"); needs --tool-call-parser.",
         None, engine=False, default=False),
    Flag("tool_call_parser", "The model's tool-call format: hermes (Qwen2.5) or llama3_json.", engine=False, default=None,
         choices=["hermes", "llama3_json"]),
    # --- the model and its memory (vLLM's names)
    Flag("tokenizer", "Tokenizer directory (default: the model's)."),
    Flag("hf_overrides", 'vLLM\'s: keys merged into the model\'s config.json before it is read, as JSON, e.g. '
         '\'{"max_position_embeddings": 8192}\' (HF checkpoints only).', json_object),
    Flag("trust_remote_code", "Allow custom code from the model repository.", None),
    Flag("skip_tokenizer_init", "Load no tokenizer: prompts must be token ids and outputs carry no text.", None),
    Flag("load_format", "auto (the checkpoint), or dummy: random weights in its shapes, for timing."),
    Flag("dtype", "Weights and activations: auto, float32, float16 (half) or bfloat16."),
    Flag("quantization", "Target weights: fp8 or int4 (quantised at load), or gptq / awq (the checkpoint's own; "
         "default: the checkpoint's quantization_config, else none).", choices=QUANTIZATION_METHODS),
    Flag("seed", "Random seed for sampling without a per-request seed.", int),
    Flag("max_model_len", "Context length: prompt plus output (default: the model's).", int),
    Flag("max_num_seqs", "Most sequences in one batch.", int),
    Flag("max_num_batched_tokens", "Most tokens in one step; longer prefills are chunked (default: max(2048, max_num_seqs)).", int),
    Flag("max_logprobs", "Most logprobs, top_logprobs or prompt_logprobs one request may ask for, as vLLM's; -1: no cap.", int),
    Flag("generation_config", "vLLM's: auto (the sampling defaults of the model's generation_config.json for the fields a "
         "request leaves unset), vllm (none), or a directory holding a generation_config.json."),
    Flag("override_generation_config", 'vLLM\'s: default sampling parameters set over --generation-config\'s, as JSON '
         f'under generation_config.json\'s names, e.g. \'{{"temperature": 0.5}}\'; its keys: {", ".join(GENERATION_CONFIG_FIELDS)}.',
         json_object),
    Flag("gpu_memory_utilization", "Fraction of GPU memory hetero may use (weights + KV cache).", float),
    Flag("kv_cache_space", "GiB of KV cache when the target runs on the CPU (vLLM's VLLM_CPU_KVCACHE_SPACE).", float),
    Flag("kv_cache_memory_bytes", "vLLM's: the KV cache's size in bytes (per GPU); given, it sizes the cache on any "
         "device, and --gpu-memory-utilization and --kv-cache-space are ignored.", int),
    Flag("num_gpu_blocks_override", "KV cache blocks, overriding what the memory settings give (vLLM's flag).", int),
    Flag("block_size", "Tokens per KV cache block: 8, 16, 32, 64 or 128.", int),
    Flag("enable_prefix_caching", "Reuse the KV of prompts' shared prefixes.", None),
    Flag("enable_prefix_cache_offload", "TACO-LLM: copy prefix-cache blocks evicted from device memory to a CPU pool "
         "and restore them on a hit instead of recomputing them.", None),
    Flag("apc_offload_min_access_threshold", "TACO-LLM: offload a block once it has been used this many times.", int),
    Flag("apc_offload_enable_hit_cnt", "TACO-LLM: log where prompts' blocks were found (device, CPU, not hit) "
         "every 100 blocks.", None),
    Flag("cpu_offload_gib", "GiB of host memory for the prefix cache offload pool.", float),
    Flag("enforce_eager", "Never capture CUDA graphs.", None),
    Flag("num_scheduler_steps", "Decode steps per host round trip, 1-64 (default: 8 on CUDA, 1 on the CPU).", int),
    Flag("async_scheduling", "Launch the next step on the device before the last one's outputs are built "
         "and streamed (vLLM V1's async scheduling).", None),
    Flag("tensor_parallel_size", "GPUs the target model is split across (1, 2, 4 or 8; tensor parallelism).", int),
    Flag("disable_custom_all_reduce", "Keep every tensor-parallel all-reduce on NCCL (default: those of up to 1 MiB "
         "go through the one-shot all-reduce over NVLink peer-to-peer memory, NCCL being the fallback).", None),
    Flag("device", "Where the target runs: auto, cpu, cuda or cuda:N."),
    Flag("batch_invariant", "Each token's KV and logits bit-identical whatever the batch "
         "(slower; also $HETERO_BATCH_INVARIANT=1).", None),
    # --- speculation (vLLM and TACO-LLM names)
    Flag("speculative_model", "Draft model directory or .gguf; drafts on the CPU."),
    Flag("num_speculative_tokens", "Draft tokens (tree nodes) per sequence per step, 1-63.", int),
    Flag("speculative_config", 'vLLM\'s speculative config as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 8}\'; '
         f"its keys: {', '.join(SPECULATIVE_CONFIG_KEYS)} (the draft worker's settings, DraftConfig's fields).", json_object),
    Flag("cpu_draft_worker", "TACO-LLM: run the draft model in its own CPU worker process.", None),
    Flag("speculative_draft_vocab_size", "The draft's logits head over this many of the most frequent tokens "
         "(FR-Spec): a large-vocabulary draft drafts several times faster on the CPU.", int),
    Flag("speculative_token_map", "SGLang's name: a file of token ids, most frequent first (.npy, .pt, .json or text), "
         "that ranks the reduced head's tokens (default: the lowest ids, BPE merge order)."),
    Flag("lookahead_cache_config_dir", "TACO-LLM: directory with the lookahead cache's config; enables it."),
    Flag("cpu_decoding_memory_utilization", "TACO-LLM: fraction of host memory the lookahead cache may use.", float),
    Flag("ignore_prompt_for_lookahead_cache", "TACO-LLM: learn the lookahead cache from outputs only.", None),
    # --- vLLM's flags that change nothing here, at the values they accept (hetero.core.vllm_args)
    *(Flag(arg.name, f"vLLM's flag: {arg.why}, so {arg.accepted} change nothing here (default: unset).", arg.cli_type,
           engine=False, default=None) for arg in NEUTRAL_ARGS),
)

_BY_OPTION = {flag.option: flag for flag in FLAGS}


def _engine_defaults() -> dict[str, Any]:
    return {f.name: f.default for f in dataclasses.fields(EngineConfig) if f.default is not dataclasses.MISSING}


def _add_flag(group: argparse._ArgumentGroup, flag: Flag, default: Any) -> None:
    described = "(default:" in flag.help
    help_text = flag.help if described else flag.help + " (default: %(default)s)"
    kwargs: dict[str, Any] = {"dest": flag.name, "default": default, "help": help_text}
    if flag.type is None:
        kwargs["action"] = argparse.BooleanOptionalAction
    else:
        kwargs.update(type=flag.type, nargs=flag.nargs, choices=flag.choices)
    group.add_argument(flag.option, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hetero", description="hetero: speculative-decoding LLM inference.")
    parser.add_argument("--version", action="version", version=f"hetero {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{serve,models}")
    commands.add_parser("models", help="Install and list models known by name (`hetero models -h`).", add_help=False)
    serve = commands.add_parser(
        "serve",
        help="Start the OpenAI-compatible HTTP server.",
        description="Serve MODEL over OpenAI's HTTP API (/v1/completions, /v1/chat/completions, ...).",
        allow_abbrev=False,
    )
    serve.add_argument("model", nargs="?", help="HF model directory, .gguf file or packaged model name "
                       "(may instead be given as `model:` in --config).")
    serve.add_argument("--config", help="YAML file of options (keys are flag names); command-line flags override it.")
    engine_defaults = _engine_defaults()
    server_group = serve.add_argument_group("server")
    engine_group = serve.add_argument_group("engine")
    neutral_group = serve.add_argument_group("vLLM flags that change nothing here")
    for flag in FLAGS:
        if flag.engine:
            _add_flag(engine_group, flag, engine_defaults[flag.name])
        else:
            _add_flag(neutral_group if flag.name in NEUTRAL_BY_NAME else server_group, flag, flag.default)
    return parser


# ------------------------------------------------------------------ --config
def config_file_args(path: str) -> tuple[Optional[str], list[str]]:
    """(model, argv) from a vLLM-style YAML config; ValueError names what is wrong."""
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise ValueError(f"cannot read --config {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ValueError(f"--config {path} is not valid YAML: {exc}") from exc
    if data is None:
        return None, []
    if not isinstance(data, dict):
        raise ValueError(f"--config {path} must be a mapping of option names to values")
    model = data.pop("model", None)
    argv: list[str] = []
    for key, value in data.items():
        option = "--" + str(key).replace("_", "-")
        flag = _BY_OPTION.get(option)
        if flag is None:
            raise ValueError(f"unknown option {key!r} in --config {path}")
        argv.extend(_file_value_args(flag, value))
    return (str(model) if model is not None else None), argv


def _file_value_args(flag: Flag, value: Any) -> list[str]:
    if value is None:
        return []
    if flag.type is None:
        if not isinstance(value, bool):
            raise ValueError(f"{flag.name} must be true or false in --config, got {value!r}")
        return [flag.option if value else "--no-" + flag.option[2:]]
    if isinstance(value, dict):
        return [flag.option, json.dumps(value)]
    if isinstance(value, list):
        return [flag.option, *map(str, value)]
    return [flag.option, str(value)]


def subcommand_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[command]


def parse_serve_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse `hetero ...` arguments, folding in --config; exits with a usage error when bad."""
    parser = build_parser()
    argv = list(argv)
    args = parser.parse_args(argv)
    if args.config:
        try:
            file_model, file_argv = config_file_args(args.config)
        except ValueError as exc:
            parser.error(str(exc))
        # The file's values become the subcommand's defaults, so the command line still wins
        # and no list-valued option in the file can swallow the positional model.
        from_file = vars(parser.parse_args([args.command, *file_argv]))
        defaults = vars(parser.parse_args([args.command]))
        subcommand_parser(parser, args.command).set_defaults(
            **{name: value for name, value in from_file.items() if value != defaults[name]}
        )
        args = parser.parse_args(argv)
        args.model = args.model or file_model
    if not args.model:
        parser.error("the model is required: `hetero serve MODEL` or `model:` in --config")
    return args


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    neutral = {name: getattr(args, name) for name in NEUTRAL_BY_NAME if getattr(args, name) is not None}
    return EngineConfig.from_kwargs(args.model, **{f.name: getattr(args, f.name) for f in FLAGS if f.engine}, **neutral)


def load_chat_template(value: Optional[str]) -> Optional[str]:
    """vLLM's --chat-template: a file's contents, or the argument itself when it is a template."""
    if value is None:
        return None
    path = Path(value)
    if path.is_file():
        return path.read_text()
    if "{" in value:
        return value
    raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")


# ------------------------------------------------------------------ serve
def build_server_app(args: argparse.Namespace):
    """The engine and the app for parsed `serve` arguments; ValueError/TypeError when they are bad."""
    from hetero.engine import LLMEngine
    from hetero.server import ServerSettings, build_app
    from hetero.server.limits import DEFAULT_MAX_REQUEST_BODY_BYTES, RequestLimits
    from hetero.server.startup import log_startup

    config = engine_config_from_args(args)
    limits = RequestLimits(
        max_seqs_per_request=config.max_num_seqs if args.max_seqs_per_request is None else args.max_seqs_per_request,
        max_logprobs=config.max_logprobs,
        max_request_body_bytes=(
            DEFAULT_MAX_REQUEST_BODY_BYTES if args.max_request_body_bytes is None else args.max_request_body_bytes
        ),
    )
    settings = ServerSettings(
        served_model_names=args.served_model_name or [args.model],
        limits=limits,
        api_key=args.api_key or os.environ.get("HETERO_API_KEY") or None,
        chat_template=load_chat_template(args.chat_template),
        shutdown_timeout=args.shutdown_timeout,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
    )
    engine = LLMEngine(config)
    log_startup(engine, args.host, settings.api_key)
    return build_app(engine, settings)


def main(argv: Optional[Sequence[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["models"]:
        from hetero import model_store

        raise SystemExit(model_store.main(argv[1:]))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_serve_args(argv)
    try:
        app = build_server_app(args)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        print(f"hetero serve: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc
    import uvicorn

    # uvicorn turns SIGTERM/SIGINT into a graceful stop: no new connections, in-flight
    # responses finish (up to shutdown_timeout), then the app's lifespan drains the engine.
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        timeout_graceful_shutdown=args.shutdown_timeout,
    )


if __name__ == "__main__":
    main()
