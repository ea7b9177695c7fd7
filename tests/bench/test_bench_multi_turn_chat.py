import json

from bench import multi_turn_chat


def test_workload_histories_grow_from_one_system_prompt():
    workload = multi_turn_chat.build_workload(3, turns=3, system_tokens=20, user_tokens=10, reply_tokens=4, vocab_size=50)
    for chat in workload.prompts:
        assert chat[0][:20] == workload.prompts[0][0][:20]  # the shared system prompt
        for earlier, later in zip(chat, chat[1:]):
            assert later[: len(earlier)] == earlier and len(later) >= len(earlier) + 4 + 5
    assert workload.working_set_tokens == 20 + sum(len(chat[-1]) - 20 for chat in workload.prompts)


def test_offload_serves_the_same_tokens_with_fewer_prefilled(tmp_path):
    multi_turn_chat.main([
        "--kv-blocks", "16", "--system-tokens", "32", "--user-tokens", "16", "--reply-tokens", "2", "--turns", "3",
        "--concurrency", "2", "--max-model-len", "256", "--configs", "prefix cache,prefix cache + CPU offload",
        "--out", str(tmp_path),
    ])
    rows = {row["config"]: row for row in json.loads((tmp_path / "multi-turn-chat-cpu.json").read_text())["rows"]}
    cache, offload = rows["prefix cache"], rows["prefix cache + CPU offload"]
    assert cache["working_set_over_device_kv"] >= 3.0
    assert offload["outputs_equal_to_first"] == f"{offload['requests']}/{cache['requests']}"
    assert offload["cpu_restored_tokens"] > 0 and cache["cpu_restored_tokens"] == 0
    assert offload["reuse_waits"] == offload["restore_waits"] == 0  # the CPU's copies are done when queued
    assert offload["prefill_tokens_computed"] < cache["prefill_tokens_computed"]
    for row in (cache, offload):
        assert row["prefill_tokens_computed"] == row["prompt_tokens"] - row["device_hit_tokens"] - row["cpu_restored_tokens"]
    assert (tmp_path / "multi-turn-chat-cpu.md").read_text().startswith("# Multi-turn chat")
