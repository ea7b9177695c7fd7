"""The built-in agreement of the end-to-end benchmarks (bench/agreement.py), grafted on each rank's shard."""
import os

from safetensors.torch import save_file

from bench.agreement import DRAFT_FILE, draft_weights, graft_draft_into_target
from bench.e2e_speculation import write_model_dir
from bench.gpu_decode import LLAMA3_8B
from hetero import LLM, SamplingParams

TARGET = dict(LLAMA3_8B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=512, bos_token_id=0, eos_token_id=1, torch_dtype="float32")
DRAFT = dict(TARGET, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
PROMPTS = [{"prompt_token_ids": [(7 * i + 3 * j) % 500 + 2 for j in range(6)]} for i in range(4)]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _greedy(model_dir, graft_from=None, load_format="dummy", **kwargs):
    llm = LLM(model=model_dir, load_format=load_format, dtype="float32", device="cpu", max_model_len=128, **kwargs)
    if graft_from is not None:
        llm.collective_rpc(graft_draft_into_target, args=(graft_from, 0.0, 1))
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_the_graft_on_two_ranks_gives_the_one_rank_target_and_its_greedy_tokens_follow_the_draft():
    """Each rank grafts its own vocabulary rows: at tp=2 the grafted target decodes as at tp=1
    (float32), not as the random target did; and that target's greedy tokens are mostly the
    draft's own greedy tokens (the agreement the benchmarks build)."""
    target_dir, draft_dir = write_model_dir(TARGET), write_model_dir(DRAFT)
    save_file(draft_weights(draft_dir, seed=7, hot_tokens=128, cold_scale=0.8), os.path.join(draft_dir, DRAFT_FILE))
    grafted = _greedy(target_dir, graft_from=draft_dir)
    assert _greedy(target_dir, graft_from=draft_dir, tensor_parallel_size=2) == grafted
    assert _greedy(target_dir) != grafted
    drafted = _greedy(draft_dir, load_format="auto")
    agree = sum(a == b for ours, theirs in zip(grafted, drafted) for a, b in zip(ours, theirs))
    assert agree >= 0.6 * len(PROMPTS) * GREEDY.max_tokens, (agree, grafted, drafted)
