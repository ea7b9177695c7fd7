"""Tensor parallelism on the CPU (gloo): tp=2 decodes exactly as tp=1, shards load right, errors are clear.

Each rank beyond rank 0 is a spawned process, so every engine here costs a few seconds of
start-up; the tests share engines where they can.
"""
from __future__ import annotations

import gc
import json
import multiprocessing
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import torch

from gpu_target import gguf_checkpoint, tp_watchdog, tp_worker
from gpu_target.loader import default_model_path, load_config, load_state_dict
from gpu_target.runner import SequenceChunk
from gpu_target.target import CacheShape, TargetSpec, build_runner, load_model, make_kv_pool
from gpu_target.tensor_parallel import Shard, SINGLE, check_divisible
from gpu_target.tp_worker import DrivingRunner, RankDiedError, RankGroup
from hetero import LLM, SamplingParams
from tiny_models import PROMPTS, save_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
_REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def odd_qwen2_dir(tmp_path_factory) -> pathlib.Path:
    """Qwen2 (q/k/v biases) with one KV head (replicated on both ranks), tied embeddings and an
    odd vocabulary (the last rank's rows padded)."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny-qwen2-odd"), "qwen2", seed=2, num_key_value_heads=1,
                           tie_word_embeddings=True, vocab_size=321)


def _generate(model_dir, prompts, params, **kwargs):
    kwargs.setdefault("device", "cpu")
    llm = LLM(model=str(model_dir), max_model_len=256, dtype="float32", **kwargs)
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("num_scheduler_steps, disable_custom_all_reduce", [(1, True), (4, False)])
def test_tp2_greedy_equals_tp1(tiny_llama_dir, num_scheduler_steps, disable_custom_all_reduce):
    """Single steps and multi-step decoding (rank 0 broadcasts its picks between steps); asking
    for the one-shot all-reduce on the CPU falls back to gloo's."""
    expected = _generate(tiny_llama_dir, PROMPTS, GREEDY, num_scheduler_steps=num_scheduler_steps)
    got = _generate(tiny_llama_dir, PROMPTS, GREEDY, num_scheduler_steps=num_scheduler_steps, tensor_parallel_size=2,
                    disable_custom_all_reduce=disable_custom_all_reduce)
    assert got == expected


def _shard_of(runner, tag):
    """A rank's vocabulary rows and device (collective_rpc's callable: module level, so it pickles)."""
    return tag, runner.model.vocab_start, runner.model.vocab_stop, runner.device.type


def _fail_or_stall_on(runner, rank, stall_s=0.0):
    """Raise on `rank` (or, with `stall_s`, sleep there that long); the other ranks return their rank."""
    if runner.model.tp.rank == rank:
        if not stall_s:
            raise ValueError(f"boom on rank {rank}")
        time.sleep(stall_s)
    return runner.model.tp.rank


def _zero_lm_head(runner):
    with torch.no_grad():
        runner.model.lm_head.weight.zero_()


def test_collective_rpc_runs_on_every_rank_and_survives_errors_and_timeouts(tiny_llama_dir):
    """vLLM's collective_rpc at tp=2 (and on one rank): results in rank order from each rank's
    shard; a worker's exception is a RuntimeError with its traceback, rank 0's its own, a
    worker too slow for the timeout a TimeoutError whose late result the next call does not
    take for its own, an unpicklable function an error before anything is sent, and after all
    of them the engine decodes as tp=1 does. A function that zeroes the LM head on every rank
    makes every greedy token 0 (had rank 1 been skipped, its half of the vocabulary would win)."""
    one = LLM(model=str(tiny_llama_dir), max_model_len=256, dtype="float32", device="cpu")
    vocab = one.llm_engine.model_config.vocab_size
    assert one.collective_rpc(_shard_of, args=("x",)) == [("x", 0, vocab, "cpu")]
    expected = [out.outputs[0].token_ids for out in one.generate(PROMPTS[:4], GREEDY, use_tqdm=False)]
    del one
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, dtype="float32", device="cpu", tensor_parallel_size=2)
    half = -(-vocab // 2)
    assert llm.collective_rpc(_shard_of, kwargs=dict(tag="y")) == [("y", 0, half, "cpu"), ("y", half, vocab, "cpu")]
    assert llm.collective_rpc("copy_kv_slots", args=([],)) == [None, None]  # a runner method by name
    with pytest.raises(RuntimeError, match=r"(?s)tensor-parallel rank 1 raised:.*ValueError: boom on rank 1"):
        llm.collective_rpc(_fail_or_stall_on, args=(1,))
    with pytest.raises(ValueError, match="boom on rank 0"):
        llm.collective_rpc(_fail_or_stall_on, args=(0,))
    with pytest.raises(TimeoutError, match=r"ranks \[1\] did not reply within 0.2 s"):
        llm.collective_rpc(_fail_or_stall_on, timeout=0.2, args=(1, 1.5))
    assert llm.collective_rpc(_shard_of, args=("z",)) == [("z", 0, half, "cpu"), ("z", half, vocab, "cpu")]
    with pytest.raises(Exception, match="pickle"):
        llm.collective_rpc(lambda runner: None)
    assert [out.outputs[0].token_ids for out in llm.generate(PROMPTS[:4], GREEDY, use_tqdm=False)] == expected
    llm.collective_rpc(_zero_lm_head)
    zeroed = [out.outputs[0].token_ids for out in llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)]
    assert zeroed == [[0] * GREEDY.max_tokens] * 2


def test_tp4_greedy_equals_tp1_with_each_kv_head_on_two_ranks(tiny_llama_dir):
    """Four ranks over the tiny model's two KV heads: each KV head is replicated on two ranks,
    each rank holding one query head."""
    expected = _generate(tiny_llama_dir, PROMPTS[:4], GREEDY)
    assert _generate(tiny_llama_dir, PROMPTS[:4], GREEDY, tensor_parallel_size=4) == expected


TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
# Few graph buckets (4 sequences, trees of 4 nodes, 320-token steps): each one is warmed up and
# captured on every rank, with Triton's float32 kernels compiled at first use on a fresh host.
_CUDA = dict(device="cuda", gpu_memory_utilization=0.3, max_num_seqs=4, max_num_batched_tokens=256)
_COPY_PARAMS = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(autouse=True)
def _return_cached_gpu_memory():
    """After each test, this process's cached CUDA blocks go back to the device: a later test's
    engine in a subprocess sizes its KV cache from what other processes hold."""
    yield
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def one_gpu_outputs(tiny_llama_dir):
    """tp = 1 on CUDA (graphs, multi-step decoding): PROMPTS' greedy outputs, and a prompt that
    repeats itself with its own greedy output (which lookahead trees then copy)."""
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, dtype="float32", **_CUDA)
    plain = [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    seed = llm.generate(["The capital of Italy is Rome. The capital of"], _COPY_PARAMS, use_tqdm=False)[0].outputs[0].token_ids
    copy_prompt = {"prompt_token_ids": list(seed) + list(seed)}
    copied = llm.generate(copy_prompt, _COPY_PARAMS, use_tqdm=False)[0].outputs[0].token_ids
    del llm
    return plain, copy_prompt, copied


@TWO_GPUS
@pytest.mark.parametrize("disable_custom_all_reduce", [True, False], ids=["nccl", "one-shot"])
def test_tp2_on_two_gpus_equals_tp1_with_graphs_and_lookahead(tiny_llama_dir, tmp_path, monkeypatch, one_gpu_outputs,
                                                              disable_custom_all_reduce):
    """NCCL or the one-shot all-reduce inside CUDA graphs, multi-step decoding (steps without
    trees) and tree verification (the copy prompt), in float32. A start-up stall fails within
    two minutes naming each rank's phase, instead of hanging."""
    monkeypatch.setattr(tp_watchdog, "STALL_TIMEOUT_S", 120.0)
    plain, copy_prompt, copied = one_gpu_outputs
    (tmp_path / "lookahead_cache_config.json").write_text(
        '{"cache_mode": 2, "copy_length": 8, "is_debug": false, "target_parallelism": 64}')
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, dtype="float32", tensor_parallel_size=2,
              lookahead_cache_config_dir=str(tmp_path), num_speculative_tokens=4,
              disable_custom_all_reduce=disable_custom_all_reduce, **_CUDA)
    engine = llm.llm_engine
    assert (engine.model.tp.one_shot is None) == disable_custom_all_reduce  # the path under test is the one in use
    assert [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == plain
    engine.spec_control.always_speculate = True
    assert llm.generate(copy_prompt, _COPY_PARAMS, use_tqdm=False)[0].outputs[0].token_ids == copied
    assert engine.spec_stats.num_accepted_tokens > 0  # trees were verified, not only plain steps


@TWO_GPUS
def test_a_second_one_shot_engine_in_the_same_process_starts(tiny_llama_dir, monkeypatch, one_gpu_outputs):
    """Rank 0 lives in the engine's process, its peers in fresh ones: the second engine's
    symmetric-memory rendezvous must still meet its new peers (it stalled until each group
    counted its exchanges from its own first: custom_all_reduce.ExchangeKeyStore)."""
    monkeypatch.setattr(tp_watchdog, "STALL_TIMEOUT_S", 120.0)
    for _ in range(2):
        llm = LLM(model=str(tiny_llama_dir), max_model_len=256, dtype="float32", tensor_parallel_size=2, **_CUDA)
        assert llm.llm_engine.model.tp.one_shot is not None
        assert [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == one_gpu_outputs[0]
        del llm


def test_tp2_with_replicated_kv_head_padded_vocab_and_biases(odd_qwen2_dir):
    expected = _generate(odd_qwen2_dir, PROMPTS[:4], GREEDY)
    assert _generate(odd_qwen2_dir, PROMPTS[:4], GREEDY, tensor_parallel_size=2) == expected


def test_tp2_lookahead_speculation_equals_tp1(tiny_llama_dir, tmp_path):
    """Tree verification and the accepted path's KV compaction run on every rank's KV heads."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    seed = _generate(tiny_llama_dir, ["The capital of Italy is Rome. The capital of"], params)[0]
    copy_prompt = {"prompt_token_ids": seed + seed}
    expected = _generate(tiny_llama_dir, [copy_prompt], params)
    (tmp_path / "lookahead_cache_config.json").write_text('{"cache_mode": 2, "copy_length": 8, "is_debug": false}')
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, dtype="float32", device="cpu", tensor_parallel_size=2,
              lookahead_cache_config_dir=str(tmp_path))
    llm.llm_engine.spec_control.always_speculate = True
    out = llm.generate(copy_prompt, params, use_tqdm=False)[0]
    assert [out.outputs[0].token_ids] == expected
    assert llm.llm_engine.spec_stats.num_accepted_tokens > 0  # trees were verified, not only plain steps


@pytest.mark.parametrize("cpu_draft_worker", [True, False], ids=["worker", "in-process"])
def test_tp2_draft_model_speculation_equals_tp1(tiny_llama_dir, cpu_draft_worker):
    """A draft model (the target itself: every tree accepted) proposing for a target split over
    two ranks, from the CPU draft worker or in the engine's process: greedy output as tp=1's."""
    expected = _generate(tiny_llama_dir, PROMPTS[:4], GREEDY)
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, dtype="float32", device="cpu", tensor_parallel_size=2,
              speculative_model=str(tiny_llama_dir), cpu_draft_worker=cpu_draft_worker, num_speculative_tokens=4,
              speculative_config={"threads": 1} if cpu_draft_worker else None)
    llm.llm_engine.spec_control.always_speculate = True
    assert [out.outputs[0].token_ids for out in llm.generate(PROMPTS[:4], GREEDY, use_tqdm=False)] == expected
    assert llm.llm_engine.spec_stats.num_accepted_tokens > 0


def _prompt_logprobs(model_dir, **kwargs):
    """Each prompt token's logprob (teacher-forced) over PROMPTS, on the CPU in float32."""
    llm = LLM(model=str(model_dir), max_model_len=256, dtype="float32", device="cpu", **kwargs)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    del llm
    return torch.tensor([entry[token].logprob for out in outs
                         for token, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:])])


def test_quantised_at_load_on_two_ranks_as_on_one(tmp_path):
    """Each rank quantises its own slices. 4-bit groups of 128 along K start where a rank's share
    of a row-parallel projection starts (256 and 512 columns: two shares of whole groups), so tp=2
    holds tp=1's codes and scales and scores the prompts as tp=1 does; FP8's per-channel scales
    of a row-parallel projection span a rank's half of K, so its scores move, but no further
    from full precision's than tp=1's FP8 scores are."""
    model_dir = save_tiny_model(tmp_path, "llama", hidden_size=256, intermediate_size=512)
    full = _prompt_logprobs(model_dir)
    int4_one, int4_two = (_prompt_logprobs(model_dir, quantization="int4", tensor_parallel_size=tp) for tp in (1, 2))
    torch.testing.assert_close(int4_two, int4_one, rtol=0, atol=1e-4)
    fp8_one, fp8_two = (_prompt_logprobs(model_dir, quantization="fp8", tensor_parallel_size=tp) for tp in (1, 2))
    assert not torch.equal(fp8_two, fp8_one)
    assert (fp8_two - full).abs().mean() <= 1.5 * (fp8_one - full).abs().mean()


def test_a_pre_quantised_checkpoint_is_one_gpu_only_for_now(tiny_llama_dir, tmp_path):
    model_dir = tmp_path / "fp8-checkpoint"
    shutil.copytree(tiny_llama_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"pre-quantised \(fp8\) checkpoint is not supported with tensor_parallel_size > 1"):
        LLM(model=str(model_dir), max_model_len=256, dtype="float32", device="cpu", tensor_parallel_size=2)


def _concat_shards(name, shards, config):
    part = Shard(0, len(shards)).slice_of(name, config)
    return shards[0][name] if part is None else torch.cat([s[name] for s in shards], dim=part[0])


def test_sharded_hf_loading_reads_each_ranks_slice(tiny_llama_dir):
    config = load_config(tiny_llama_dir)
    whole = load_state_dict(tiny_llama_dir, config, torch.float32, "cpu")
    shards = [load_state_dict(tiny_llama_dir, config, torch.float32, "cpu", shard=Shard(r, 2)) for r in range(2)]
    assert shards[0]["model.layers.0.self_attn.q_proj.weight"].shape[0] == config.q_size // 2
    assert shards[1]["model.layers.0.self_attn.o_proj.weight"].shape[1] == config.q_size // 2
    for name, tensor in whole.items():
        for rank, shard in enumerate(shards):
            assert torch.equal(shard[name], Shard(rank, 2).take(name, tensor, config)), name
        if "embed" not in name and "lm_head" not in name:
            assert torch.equal(_concat_shards(name, shards, config), tensor), name


def test_kv_heads_are_replicated_when_fewer_than_ranks(odd_qwen2_dir):
    config = load_config(odd_qwen2_dir)
    shards = [load_state_dict(odd_qwen2_dir, config, torch.float32, "cpu", shard=Shard(r, 2)) for r in range(2)]
    for name in ("model.layers.0.self_attn.k_proj.weight", "model.layers.1.self_attn.v_proj.bias"):
        assert shards[0][name].shape[0] == config.head_dim and torch.equal(shards[0][name], shards[1][name])
    embed = "model.embed_tokens.weight"
    assert shards[0][embed].shape[0] == 161 and shards[1][embed].shape[0] == 160  # 321 rows, the last rank's short


def _smollm2():
    try:
        return default_model_path()
    except FileNotFoundError as missing:
        pytest.skip(str(missing))


def test_sharded_gguf_loading_on_smollm2():
    """SmolLM2-135M's 9 heads and 3 KV heads split three ways (Q4_1 tensors, rotary rows unpermuted first)."""
    path = _smollm2()
    config = load_config(path)
    names = [f"model.layers.0.{p}" for p in ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                              "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.down_proj.weight",
                                              "input_layernorm.weight")] + ["model.embed_tokens.weight"]
    whole = gguf_checkpoint.load_tensors(path, config, names, torch.float32, torch.device("cpu"))
    for rank in range(3):
        shard = Shard(rank, 3)
        part = gguf_checkpoint.load_tensor_slices(path, config, {n: shard.slice_of(n, config) for n in names},
                                                  torch.float32, torch.device("cpu"))
        for name in names:
            assert torch.equal(part[name], shard.take(name, whole[name], config)), (rank, name)


def _greedy_with_runner(runner, prompts: list[list[int]], new_tokens: int, block_size: int) -> list[list[int]]:
    """Prefill each prompt, then decode greedily, one sequence per block range, straight on a runner."""
    blocks_per_seq = 8
    out = []
    for s, prompt in enumerate(prompts):
        table = list(range(s * blocks_per_seq, (s + 1) * blocks_per_seq))
        tokens = list(prompt)
        chunk = SequenceChunk(tokens, list(range(len(tokens))), table, 0, [len(tokens) - 1])
        for _ in range(new_tokens):
            tokens.append(int(runner.forward([chunk]).argmax(-1)[0]))
            n = len(tokens) - 1
            chunk = SequenceChunk([tokens[-1]], [n], table, n, [0])
        out.append(tokens[len(prompt):])
    return out


def test_smollm2_three_ranks_decode_as_one():
    """Real weights through the whole rank machinery. SmolLM2's 9 heads split only three ways,
    which `tensor_parallel_size` does not offer (1/2/4/8), so the ranks are driven directly."""
    path = _smollm2()
    config = load_config(path)
    spec = TargetSpec(str(path), config, torch.float32, "cpu", True, 0, None, False, 16, True)
    shape = CacheShape(32, 4, 1, 128, 256)
    prompts = [[1, 504, 3458, 314, 4649, 314], [1, 9856, 28, 957]]
    single = build_runner(spec, load_model(spec, SINGLE, torch.device("cpu")),
                          make_kv_pool(spec, SINGLE, shape.num_blocks, torch.device("cpu")), SINGLE, shape)
    expected = _greedy_with_runner(single, prompts, 6, 16)
    del single
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # three ranks on a small CI machine: as the engine does, one share each
    ranks = RankGroup(spec, 3, num_threads=1)
    try:
        model = load_model(spec, ranks.tp, torch.device("cpu"))
        ranks.wait_for("loaded")
        ranks.build(shape)
        runner = build_runner(spec, model, make_kv_pool(spec, ranks.tp, shape.num_blocks, torch.device("cpu")), ranks.tp, shape)
        ranks.wait_for("built")
        assert _greedy_with_runner(DrivingRunner(runner, ranks), prompts, 6, 16) == expected
    finally:
        ranks.close()
        torch.set_num_threads(threads)
    assert not any(p.is_alive() for p in ranks.processes)


def test_tp_size_errors(tiny_llama_dir, monkeypatch):
    with pytest.raises(ValueError, match="tensor_parallel_size must be 1, 2, 4 or 8"):
        LLM(model=str(tiny_llama_dir), tensor_parallel_size=3)
    with pytest.raises(ValueError, match="does not divide the model's 4 attention heads"):
        LLM(model=str(tiny_llama_dir), tensor_parallel_size=8, device="cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 exceeds the 1 visible GPUs"):
        LLM(model=str(tiny_llama_dir), tensor_parallel_size=2, device="cuda", dtype="float32")


def test_smollm2_heads_not_divisible_by_two():
    path = _smollm2()
    with pytest.raises(ValueError, match="does not divide the model's 9 attention heads"):
        check_divisible(load_config(path), 2)


def _generate_in_thread(llm, prompts, params, errors: list) -> threading.Thread:
    def generate():
        try:
            llm.generate(prompts, params, use_tqdm=False)
        except BaseException as error:  # noqa: BLE001 - the test inspects it
            errors.append(error)

    thread = threading.Thread(target=generate, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("when", ["between steps", "mid-run"])
def test_a_killed_rank_is_an_error_not_a_hang(tiny_llama_dir, when):
    """Rank 0's work finishes once the group is aborted, so the watchdog, which ends the process
    only when rank 0's device stays stuck, leaves the engine to raise RankDiedError."""
    llm = LLM(model=str(tiny_llama_dir), max_model_len=512, dtype="float32", device="cpu", tensor_parallel_size=2)
    engine = llm.llm_engine
    ranks = engine._ranks
    worker = ranks.processes[0]
    assert llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)  # healthy first
    errors: list[BaseException] = []
    long_run = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    if when == "between steps":
        worker.kill()
        worker.join(30)
        thread = _generate_in_thread(llm, PROMPTS, long_run, errors)
    else:
        tokens_before = engine.num_generation_tokens_total
        thread = _generate_in_thread(llm, PROMPTS, long_run, errors)
        while engine.num_generation_tokens_total == tokens_before and thread.is_alive():
            time.sleep(0.01)
        worker.kill()
    thread.join(120)  # bounded: a hang fails the test instead of the suite
    assert not thread.is_alive(), "generate hung after a rank died"
    assert len(errors) == 1 and isinstance(errors[0], RankDiedError), errors
    assert "rank 1" in str(errors[0])
    del llm, engine
    ranks.close()
    assert not any(p.is_alive() for p in ranks.processes)


_KILL_A_RANK = pathlib.Path(__file__).with_name("tp_kill_a_rank.py")


def _run_child(path, *args: str, timeout: float = 150) -> subprocess.CompletedProcess:
    """Run a Python script with this checkout first on its path. Its output goes through files,
    not pipes, so that a grandchild left alive (what these tests look for) cannot hold the run
    open; the bound turns a hang into a failure."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(_REPO), os.environ.get("PYTHONPATH", "")]))
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        code = subprocess.run([sys.executable, str(path), *args], stdout=out, stderr=err, env=env, timeout=timeout).returncode
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(path, code, out.read(), err.read())


def _kill_a_rank(model_dir, *args: str) -> tuple[subprocess.CompletedProcess, list[int]]:
    """Run tp_kill_a_rank.py: its output and the worker pids it printed. Start-up, a healthy
    generation and the end take well under the bound."""
    run = _run_child(_KILL_A_RANK, str(model_dir), *args)
    started = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    return run, started[0]["workers"] if started else []


def _all_gone(pids: list[int], within_s: float = 30.0) -> bool:
    """Whether every process of `pids` has ended (zombies count) within `within_s`; any left are
    then killed, so that a failing test leaves none behind."""
    def alive(pid: int) -> bool:
        return os.path.exists(f"/proc/{pid}") and not _is_zombie(pid)

    deadline = time.monotonic() + within_s
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [pid for pid in pids if alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return bool(pids) and not left


def test_a_killed_rank_with_rank_0_stuck_in_a_one_shot_all_reduce_ends_the_process(tiny_llama_dir):
    """Rank 0's thread blocked for good, as in a one-shot kernel waiting for a dead rank: the
    watchdog ends the process with the error naming the rank, instead of hanging."""
    run, workers = _kill_a_rank(tiny_llama_dir, "--stuck-rank0", "--grace", "1")
    assert run.returncode == tp_watchdog.STUCK_EXIT_CODE, (run.returncode, run.stdout, run.stderr[-3000:])
    assert "tensor-parallel rank 1 (pid" in run.stderr and "exited with code -9" in run.stderr
    assert "disable_custom_all_reduce=True" in run.stderr
    assert _all_gone(workers)


def test_end_process_kills_the_surviving_workers_first(tmp_path):
    """os._exit skips multiprocessing's atexit stop of daemonic children: without the kill, a
    rank stuck on its GPU would outlive the engine."""
    script = tmp_path / "end.py"
    script.write_text(
        "import multiprocessing, sys, time\n"
        "from gpu_target import tp_watchdog\n"
        "if __name__ == '__main__':\n"
        "    context = multiprocessing.get_context('spawn')\n"
        "    workers = [context.Process(target=time.sleep, args=(600,), daemon=True) for _ in range(2)]\n"
        "    for w in workers: w.start()\n"
        "    print(' '.join(str(w.pid) for w in workers), flush=True)\n"
        "    tp_watchdog.end_process('rank 1 died; the test ends the process', workers)\n"
    )
    run = _run_child(script)
    assert run.returncode == tp_watchdog.STUCK_EXIT_CODE, run.stderr
    assert "rank 1 died; the test ends the process" in run.stderr
    pids = [int(pid) for pid in run.stdout.split()]
    assert len(pids) == 2 and _all_gone(pids)


def test_a_worker_stuck_on_its_device_ends_with_the_engines_process(tmp_path):
    """A worker whose thread never returns (as on a GPU spinning for a rank 0 that was killed)
    exits once its parent is gone, instead of outliving it."""
    script = tmp_path / "parent.py"
    script.write_text(
        "import multiprocessing, os, signal, time\n"
        "from gpu_target import tp_watchdog\n"
        "def stuck():\n"
        "    tp_watchdog.exit_with_parent()\n"
        "    time.sleep(600)\n"
        "if __name__ == '__main__':\n"
        "    worker = multiprocessing.get_context('spawn').Process(target=stuck, daemon=True)\n"
        "    worker.start()\n"
        "    print(worker.pid, flush=True)\n"
        "    time.sleep(3)  # the worker's watch is up\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    run = _run_child(script)
    assert run.returncode == -signal.SIGKILL, run.stderr
    assert _all_gone([int(pid) for pid in run.stdout.split()])


@TWO_GPUS
@pytest.mark.parametrize("disable_custom_all_reduce", [True, False], ids=["nccl", "one-shot"])
def test_a_rank_killed_on_two_gpus_ends_cleanly(tiny_llama_dir, disable_custom_all_reduce):
    """Rank 1 stopped mid-generation, so that rank 0 waits for it in a collective, then killed.
    NCCL: the abort frees rank 0, the engine raises RankDiedError and tears down. The one-shot
    all-reduce: RankDiedError if rank 0's work still finished, else the watchdog's end of the
    process; either way within the bound, naming rank 1, and no worker left."""
    args = ["--device", "cuda"] + (["--disable-custom-all-reduce"] if disable_custom_all_reduce else [])
    run, workers = _kill_a_rank(tiny_llama_dir, *args)
    print(run.stdout, run.stderr[-3000:], sep="\n")  # the outcome, shown with -s
    if disable_custom_all_reduce:
        assert run.returncode == 3 and "RankDiedError: tensor-parallel rank 1" in run.stdout
    else:
        assert '"one_shot_in_use": true' in run.stdout
        assert (run.returncode == tp_watchdog.STUCK_EXIT_CODE and "tensor-parallel rank 1 (pid" in run.stderr) or (
            run.returncode == 3 and "RankDiedError: tensor-parallel rank 1" in run.stdout), (run.returncode, run.stdout)
    if run.returncode == 3:
        assert "teardown returned" in run.stdout
    assert _all_gone(workers)


def test_engine_release_stops_the_workers(tiny_llama_dir, monkeypatch):
    """Rank 0 shuts its group down gracefully while its workers do theirs, as
    destroy_process_group has every rank do; the workers then exit on their own."""
    released = []
    real_release = tp_worker.release
    monkeypatch.setattr(tp_worker, "release",
                        lambda resources, graceful=True: (released.append(graceful), real_release(resources, graceful)))
    llm = LLM(model=str(tiny_llama_dir), max_model_len=256, dtype="float32", device="cpu", tensor_parallel_size=2)
    pids = [p.pid for p in llm.llm_engine._ranks.processes]
    processes = list(llm.llm_engine._ranks.processes)
    del llm  # no reference cycles: the finalizer runs now
    for process in processes:
        process.join(30)
    assert released == [True]
    assert [p.exitcode for p in processes] == [0]  # released and returned, not killed after the stop timeout
    assert all(not os.path.exists(f"/proc/{pid}") or _is_zombie(pid) for pid in pids)


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] == "Z"
    except FileNotFoundError:
        return True


def test_default_core_split_gives_each_worker_rank_a_core_of_its_own(monkeypatch):
    """16 cores: the coordinator keeps 0-1, worker ranks 1..3 get 2, 3 and 4, the draft 5-15."""
    from cpu_draft import affinity

    monkeypatch.setattr(affinity, "_process_cpus", frozenset(range(16)))
    assert affinity.tp_worker_cpus(3) == [[2], [3], [4]]
    assert affinity.default_draft_cpus(None, tp_workers=3) == list(range(5, 16))
    assert affinity.default_draft_cpus(None) == list(range(2, 16))
    monkeypatch.setattr(affinity, "_process_cpus", frozenset(range(64)))  # four H200s' host: 8 + 3, then 16 for the draft
    assert affinity.tp_worker_cpus(3) == [[8], [9], [10]]
    assert affinity.default_draft_cpus(None, tp_workers=3) == list(range(11, 27))
    monkeypatch.setattr(affinity, "_process_cpus", frozenset(range(2)))
    assert affinity.tp_worker_cpus(1) == []  # too few cores to pin: the ranks share them


def test_serve_flag_reaches_the_engine_and_bad_sizes_are_usage_errors(capsys):
    from hetero.cli import engine_config_from_args, main, parse_serve_args

    assert engine_config_from_args(parse_serve_args(["serve", "m", "--tensor-parallel-size", "4"])).tensor_parallel_size == 4
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "m", "--tensor-parallel-size", "3"])
    assert exit_info.value.code == 2
    assert "tensor_parallel_size must be 1, 2, 4 or 8" in capsys.readouterr().err


def test_a_stalled_rank_at_start_up_is_an_error_naming_each_ranks_phase(tiny_llama_dir, monkeypatch):
    """A worker that stops answering (SIGSTOP: alive, never reaching the collective) while rank 0
    waits in a collective, then while it waits for the workers' report: the watchdog aborts the
    group and both waits end in RankStalledError with every rank's last phase, not a hang."""
    config = load_config(tiny_llama_dir)
    spec = TargetSpec(str(tiny_llama_dir), config, torch.float32, "cpu", True, 0, None, False, 16, True)
    ranks = RankGroup(spec, 2, num_threads=1)
    worker = ranks.processes[0]
    try:
        load_model(spec, ranks.tp, torch.device("cpu"))
        ranks.wait_for("loaded")
        # Short only from here: a loaded machine may take longer than that to spawn and join.
        monkeypatch.setattr(tp_watchdog, "STALL_TIMEOUT_S", 2.0)
        os.kill(worker.pid, signal.SIGSTOP)
        errors: list[BaseException] = []

        def collective_then_wait():
            try:
                with ranks.running("summing a test tensor"):
                    ranks.tp.all_reduce(torch.ones(4))
            except BaseException as error:  # noqa: BLE001 - the test inspects it
                errors.append(error)
            try:
                ranks.wait_for("built")
            except BaseException as error:  # noqa: BLE001
                errors.append(error)

        thread = threading.Thread(target=collective_then_wait, daemon=True)
        thread.start()
        thread.join(120)  # bounded: a hang fails the test instead of the suite
        assert not thread.is_alive(), "rank 0 hung on a stalled worker"
        assert len(errors) == 2 and all(isinstance(e, tp_worker.RankStalledError) for e in errors), errors
        assert "while rank 0 was summing a test tensor" in str(errors[0])
        assert "rank 1: waiting for the KV cache shape from the coordinator" in str(errors[0])
    finally:
        worker.kill()
        ranks.close()
    assert not worker.is_alive()


class _ReapedElsewhere:
    """A worker that has exited while another thread reaps it: `is_alive` reads True for the
    first `late` looks (the Popen's exit code not yet recorded), as in that race."""

    def __init__(self, process, late: int):
        self.process, self.late = process, late
        self.sentinel, self.pid = process.sentinel, process.pid

    def is_alive(self) -> bool:
        self.late -= 1
        return self.late >= 0 or self.process.is_alive()

    def join(self, timeout=None) -> None:
        pass  # the other thread reaps it

    @property
    def exitcode(self):
        return self.process.exitcode


def test_a_collective_failure_names_the_rank_whose_exit_is_recorded_late():
    """A collective fails on the dead peer's closed socket while the watchdog's thread is reaping
    it: the grace period keeps looking until the exit shows, so the error names rank 1."""
    process = multiprocessing.get_context("spawn").Process(target=os._exit, args=(3,))
    process.start()
    process.join(30)
    group = RankGroup.__new__(RankGroup)
    group.watchdog = type("Watchdog", (), {"stalled": None})()
    group.processes, group.conns = [_ReapedElsewhere(process, late=5)], [type("Conn", (), {"poll": lambda self: False})()]
    with pytest.raises(RankDiedError, match=r"rank 1 \(pid \d+\) exited with code 3"):
        group.check_alive(grace_s=tp_watchdog.DEATH_GRACE_S)
