"""The draft-model proposers: KV rollback, greedy equivalence, worker faults, vocabulary checks."""
from __future__ import annotations

import json
import logging
import os
import signal
import time

import pytest
import torch

from cpu_draft.draft_kv import slot_kv_dtype
from cpu_draft.drafter import DraftModelOptions, Drafter, tree_levels
from cpu_draft.messages import ContextUpdate, read_updates, split_updates, update_arrays
from cpu_draft.slot_kv import SlotHandle, SlotKVCache
from hetero import LLM, SamplingParams
from ipc.segment import SHM_DIR, owner_pid_of
from tiny_models import save_tiny_model

K = 4
# Every LLM here keeps its target on the CPU, GPU or not: the tiny models' head_dim (8) is below the
# GPU attention kernel's 16, and these tests are about the draft worker, not the target.
PROMPTS = [
    "The capital of France is",
    "Hello, my name is",
    "def add(a, b):",
    "Speculative decoding drafts tokens on the CPU and",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def no_draft_channel_left():
    """Runs last in this module: every worker channel this process created is gone from /dev/shm."""
    yield
    left = [n for n in os.listdir(SHM_DIR) if n.startswith("hetero-draft") and owner_pid_of(n) == os.getpid()]
    assert not left, f"draft channels left in {SHM_DIR}: {left}"


@pytest.fixture(scope="module")
def other_draft_dir(tmp_path_factory):
    """A smaller random model with the target's tokenizer: mostly rejected."""
    return save_tiny_model(
        tmp_path_factory.mktemp("tiny-draft"), "llama", seed=7, hidden_size=32, intermediate_size=64, num_hidden_layers=1
    )


@pytest.fixture(scope="module")
def plain_outputs(tiny_llama_dir):
    llm = LLM(device="cpu", model=str(tiny_llama_dir), dtype="float32")
    return {
        "batch1": [_tokens(llm.generate(p, GREEDY, use_tqdm=False))[0] for p in PROMPTS],
        "batch4": _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)),
    }


def _tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def _always_speculate(llm: LLM) -> None:
    """Keep the engine from switching speculation off when the tiny draft measures slower than plain decoding."""
    llm.llm_engine.spec_control.always_speculate = True


def _worker_llm(model_dir) -> LLM:
    """The tiny model drafting for itself in a CPU worker, always speculating."""
    llm = LLM(device="cpu", model=str(model_dir), speculative_model=str(model_dir), num_speculative_tokens=K,
              cpu_draft_worker=True, dtype="float32")
    _always_speculate(llm)
    return llm


def _close(llm: LLM) -> None:
    proposer = llm.llm_engine.proposer
    if hasattr(proposer, "close"):
        proposer.close()


# ----------------------------------------------------------------- drafter
def _drafter(model_dir, **options) -> Drafter:
    return Drafter.load(str(model_dir), DraftModelOptions(dtype=torch.float32, **options))


@pytest.mark.parametrize("layout, kv_dtype", [("slots", None), ("slots", "bfloat16"), ("paged", None)])
def test_rollback_leaves_kv_as_if_rejected_tokens_never_happened(tiny_llama_dir, layout, kv_dtype):
    prompt = list(range(40, 71))
    speculated = _drafter(tiny_llama_dir, kv_layout=layout, kv_dtype=kv_dtype)
    speculated.set_context("s", prompt)
    chain = speculated.draft([("s", 6)])[0].tokens.tolist()
    assert speculated.kv_length("s") == len(prompt) + 5  # the chain's K/V, all but its last token
    bonus = (chain[2] + 1) % speculated.vocab_size  # the target rejected chain[2] and chose another token
    accepted = prompt + chain[:2] + [bonus]
    if layout == "slots":  # rollback is a length change: the storage is neither copied nor written
        storage, before = speculated.kv.cache.storage, speculated.kv.cache.storage.clone()
    speculated.set_context("s", accepted)
    if layout == "slots":
        assert speculated.kv.cache.storage is storage and torch.equal(storage, before)
        assert storage.dtype == (torch.bfloat16 if kv_dtype else torch.float32)

    fresh = _drafter(tiny_llama_dir, kv_layout=layout, kv_dtype=kv_dtype)  # sees the accepted tokens only, fed the same way (one per forward)
    fresh.set_context("s", prompt)
    assert fresh.draft([("s", 3)])[0].tokens.tolist() == chain[:3]
    fresh.set_context("s", accepted)

    assert speculated.kv_length("s") == fresh.kv_length("s") == len(prompt) + 2
    assert torch.equal(speculated.kv_snapshot("s"), fresh.kv_snapshot("s"))
    if layout == "paged":
        assert speculated.kv.allocator.num_free == fresh.kv.allocator.num_free  # blocks past the end went back
    next_speculated = speculated.draft([("s", 5)])[0]
    next_fresh = fresh.draft([("s", 5)])[0]
    assert next_speculated.tokens.tolist() == next_fresh.tokens.tolist()
    assert torch.equal(speculated.kv_snapshot("s"), fresh.kv_snapshot("s"))

    cold = _drafter(tiny_llama_dir, kv_layout=layout, kv_dtype=kv_dtype)  # a drafter that prefills the accepted context in one go agrees too
    cold.set_context("s", accepted)
    assert cold.draft([("s", 5)])[0].tokens.tolist() == next_fresh.tokens.tolist()


@pytest.mark.parametrize("layout", ["slots", "paged"])
def test_batched_drafting_matches_one_sequence_at_a_time(tiny_llama_dir, layout):
    contexts = {"a": list(range(10, 30)), "b": list(range(100, 103)), "c": list(range(7, 60))}
    batched = _drafter(tiny_llama_dir, tree_width=3, kv_layout=layout)
    for seq_id, tokens in contexts.items():
        batched.set_context(seq_id, tokens)
    together = batched.draft([(s, 7) for s in contexts])
    for (seq_id, tokens), tree in zip(contexts.items(), together):
        alone = _drafter(tiny_llama_dir, tree_width=3, kv_layout=layout)
        alone.set_context(seq_id, tokens)
        assert alone.draft([(seq_id, 7)])[0].tokens.tolist() == tree.tokens.tolist()
        assert len(tree) == 7 and tree.depths().max() == 3  # ceil(7 / 3) levels, siblings on the first two


@pytest.mark.parametrize("width", [1, 2])
def test_a_draft_shrunk_to_a_smaller_budget_equals_drafting_with_it(tiny_llama_dir, width):
    context = list(range(30, 52))
    big, small = _drafter(tiny_llama_dir, tree_width=width), _drafter(tiny_llama_dir, tree_width=width)
    big.set_context("s", context)
    small.set_context("s", context)
    shrunk = big.shrink_last_draft("s", big.draft([("s", 9)])[0], 5)
    expected = small.draft([("s", 5)])[0]
    assert shrunk.tokens.tolist() == expected.tokens.tolist()
    assert shrunk.parents.tolist() == expected.parents.tolist()
    assert big.last_chain("s") == small.last_chain("s") and big.kv_length("s") == small.kv_length("s")


@pytest.mark.parametrize("model_fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_slot_layout_drafts_what_the_paged_layout_drafts(model_fixture, request):
    """The lean CPU forward (slots) against `CausalLM` (paged): the same drafts and, up to rounding, the same K/V.

    Over steps of accept / reject / new and finished sequences, in an order that breaks slot order.
    """
    model_dir = request.getfixturevalue(model_fixture)
    slots, paged = _drafter(model_dir, kv_layout="slots"), _drafter(model_dir, kv_layout="paged")

    def same_kv(seq_id):
        assert torch.allclose(slots.kv_snapshot(seq_id), paged.kv_snapshot(seq_id), atol=1e-5)

    draft_side_by_side(slots, paged, same_kv)


def draft_side_by_side(first: Drafter, second: Drafter, check_kv, roll_back: bool = False) -> None:
    """Six draft steps of both drafters over the same sequences: each step some take their
    whole chain, some part, some none, then a diverging bonus; requests come in an order
    that breaks slot order; after step 2 one sequence finishes and another takes its slot
    (and with `roll_back`, one rolls back to a shorter context). Both must draft the same
    chains at every step; `check_kv(seq_id)` compares their K/V after each."""
    contexts = {"a": list(range(10, 30)), "b": list(range(100, 103)), "c": list(range(7, 60)), "d": [5]}
    for step in range(6):
        for drafter in (first, second):
            for seq_id, tokens in contexts.items():
                drafter.set_context(seq_id, tokens)
        requests = [(s, 4) for s in reversed(contexts)] if step % 2 else [(s, 4) for s in contexts]
        drafted = [drafter.draft(requests) for drafter in (first, second)]
        assert [t.tokens.tolist() for t in drafted[0]] == [t.tokens.tolist() for t in drafted[1]]
        for seq_id, tree in zip([s for s, _ in requests], drafted[0]):
            chain = tree.tokens.tolist()
            accepted = chain[: (step + len(seq_id)) % 5]
            contexts[seq_id] = contexts[seq_id] + accepted + [(sum(accepted) + step) % first.vocab_size]
        for seq_id in contexts:
            check_kv(seq_id)
        if step == 2:
            del contexts["b"]
            first.release("b"), second.release("b")
            contexts["e"] = list(range(200, 230))
            if roll_back:
                contexts["c"] = contexts["c"][:40] + [3, 1, 4]


def test_slot_storage_grows_and_compacts_without_losing_kv(tiny_llama_dir):
    drafter = _drafter(tiny_llama_dir, kv_layout="slots")
    cache = drafter.kv.cache
    drafter.set_context("a", list(range(1, 20)))
    drafter.set_context("b", list(range(30, 40)))
    drafter.draft([("a", 2), ("b", 2)])
    drafter.release("a")
    before = drafter.kv_snapshot("b")
    long_context = list(range(cache.capacity + 5))  # past the capacity: the storage regrows, "b" moves to slot 0
    drafter.set_context("c", long_context)
    drafter.draft([("c", 2)])
    assert cache.capacity >= len(long_context) + 1
    assert drafter.kv.cache._holders[0] is drafter._seqs["b"].kv
    assert torch.equal(drafter.kv_snapshot("b"), before)


def test_slot_cache_over_budget_evicts_sequences_outside_the_batch(tiny_llama_dir):
    probe = _drafter(tiny_llama_dir, kv_layout="slots")
    per_slot = probe.kv.cache.bytes_per_token * 256
    drafter = _drafter(tiny_llama_dir, kv_layout="slots", kv_cache_bytes=2 * per_slot)
    for seq_id in "abc":
        drafter.set_context(seq_id, list(range(10, 20)))
        assert len(drafter.draft([(seq_id, 3)])[0]) == 3  # the third evicts the KV of one of the others
    assert sum(drafter.kv_length(s) > 0 for s in "abc") == 2
    tokens = [t.tokens.tolist() for t in drafter.draft([(s, 3) for s in "abc"])]
    assert sum(len(t) == 3 for t in tokens) == 2  # no room for all three in one batch: one goes without


def test_bf16_kv_hold_twice_the_tokens_in_one_budget(tiny_llama_dir):
    float_kv, bf16_kv = (_drafter(tiny_llama_dir, kv_layout="slots", kv_dtype=d) for d in ("float32", "bfloat16"))
    assert bf16_kv.kv.cache.bytes_per_token * 2 == float_kv.kv.cache.bytes_per_token
    budget = 4 * float_kv.kv.cache.bytes_per_token * 256  # four slots of 256 float32 tokens
    caches = [SlotKVCache(float_kv.config, dtype, budget, 4096) for dtype in (torch.float32, torch.bfloat16)]
    for cache in caches:
        handles = [SlotHandle() for _ in range(8)]
        held = sum(cache.reserve(h, 256) for h in handles)
        assert cache.storage.numel() * cache.storage.element_size() <= budget
        assert held == (4 if cache.dtype == torch.float32 else 8)


def test_kv_dtype_defaults_and_choices(tiny_llama_dir):
    """float32 K/V unless bf16 is asked for; the paged layout keeps the model's dtype and refuses another."""
    assert slot_kv_dtype(None) == slot_kv_dtype("float32") == torch.float32
    assert slot_kv_dtype("bfloat16") == torch.bfloat16
    with pytest.raises(ValueError, match="K/V dtype"):
        slot_kv_dtype("int8")
    with pytest.raises(ValueError, match="paged"):
        _drafter(tiny_llama_dir, kv_layout="paged", kv_dtype="bfloat16")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_linear_matches_f_linear(dtype):
    from cpu_draft.packed_linear import PackedLinear, can_pack

    if not can_pack(dtype):
        pytest.skip("oneDNN packed linear is unavailable here")
    generator = torch.Generator().manual_seed(0)
    weight, bias = (torch.randn(48, 64, generator=generator).to(dtype), torch.randn(48, generator=generator).to(dtype))
    for rows in (1, 8, 33):
        x = torch.randn(rows, 64, generator=generator).to(dtype)
        packed, plain = PackedLinear(weight, bias)(x), torch.nn.functional.linear(x, weight, bias)
        if dtype == torch.bfloat16:
            assert torch.equal(packed, plain)
        else:
            assert torch.allclose(packed, plain, atol=1e-5)


def test_per_forward_attention_equals_the_reference():
    from cpu_draft.attention import PerForwardAttention
    from gpu_target.attention import reference_attention
    from gpu_target.runner import ModelRunner, SequenceChunk

    runner = ModelRunner.__new__(ModelRunner)  # only build_inputs is used: no model needed
    runner.block_size, runner.device = 4, torch.device("cpu")
    chunks = [  # a prefill chunk, a decode token, a short catch-up, over scattered blocks
        SequenceChunk(list(range(6)), range(0, 6), [3, 7], 0, [5]),
        SequenceChunk([1], [9], [0, 5, 9], 9, [0]),
        SequenceChunk([2, 3], [4, 5], [2, 8], 4, [1]),
    ]
    _, _, meta, _ = runner.build_inputs(chunks)
    generator = torch.Generator().manual_seed(0)
    attention = PerForwardAttention()
    for _ in range(2):  # two "layers" of one forward share the prepared indices and mask
        k_cache, v_cache = (torch.randn(10, 4, 2, 8, generator=generator) for _ in range(2))
        query = torch.randn(meta.num_tokens, 4, 8, generator=generator)
        assert torch.equal(attention(query, k_cache, v_cache, meta, 0.3), reference_attention(query, k_cache, v_cache, meta, 0.3))


def test_tree_levels_respect_the_budget():
    assert tree_levels(0, 2) == []
    assert tree_levels(4, 1) == [1, 1, 1, 1]
    assert tree_levels(5, 2) == [2, 2, 1]
    assert tree_levels(16, 4) == [4, 4, 4, 4]
    for budget in range(1, 64):
        for width in range(1, 6):
            assert sum(tree_levels(budget, width)) == budget


@pytest.mark.parametrize("layout", ["slots", "paged"])
def test_int8_weights_stay_close_to_float(tiny_llama_dir, layout):
    """The torch forwards' INT8 layers (the native forward's: tests/cpu_draft/test_native_draft.py)."""
    float_drafter = _drafter(tiny_llama_dir, kv_layout=layout, native_kernels=False)
    int8_drafter = _drafter(tiny_llama_dir, kv_layout=layout, int8_weights=True, native_kernels=False)
    model = int8_drafter.kv.model if layout == "slots" else int8_drafter.kv.runner.model
    down = model.layers[0].down if layout == "slots" else model.layers[0].mlp.down_proj
    assert type(down).__name__ == "Int8Linear"
    assert 0 < int8_logit_error(float_drafter, int8_drafter) < 0.02


def int8_logit_error(float_drafter: Drafter, int8_drafter: Drafter) -> float:
    """Relative error of the INT8 drafter's logits over a 32-token prompt, against the float one's."""
    tokens = list(range(20, 52))
    logits = []
    for drafter in (float_drafter, int8_drafter):
        handle = drafter.kv.new_handle()
        assert drafter.kv.reserve(handle, len(tokens))
        logits.append(drafter.kv.forward([handle], [0], [tokens]))
    return float((logits[1] - logits[0]).norm() / logits[0].norm())


def test_update_messages_round_trip_when_split():
    updates = [ContextUpdate(1, 0, list(range(25))), ContextUpdate(2, 7, []), ContextUpdate(3, 4, [9, 8, 7])]
    contexts: dict[int, list[int]] = {2: list(range(50, 60)), 3: [1, 2, 3, 4, 5]}
    for group in split_updates(updates, max_tokens=10):
        assert sum(len(u.new_tokens) for u in group) <= 10
        for u in read_updates(update_arrays(group)):
            contexts[u.seq_id] = contexts.get(u.seq_id, [])[: u.keep] + u.new_tokens
    assert contexts == {1: list(range(25)), 2: list(range(50, 57)), 3: [1, 2, 3, 4, 9, 8, 7]}


# ------------------------------------------------------ engine equivalence
@pytest.mark.parametrize(
    "worker, draft, tree_width",
    [(True, "same", 1), (True, "other", 1), (False, "same", 1), (False, "other", 1), (False, "other", 3)],
)
def test_greedy_output_equals_plain_decoding(
    worker, draft, tree_width, tiny_llama_dir, other_draft_dir, plain_outputs, monkeypatch
):
    monkeypatch.setenv("HETERO_DRAFT_TREE_WIDTH", str(tree_width))
    draft_dir = tiny_llama_dir if draft == "same" else other_draft_dir
    llm = LLM(
        device="cpu", model=str(tiny_llama_dir),
        speculative_model=str(draft_dir),
        num_speculative_tokens=K if tree_width == 1 else 2 * K,
        cpu_draft_worker=worker,
        dtype="float32",
    )
    _always_speculate(llm)
    try:
        assert [_tokens(llm.generate(p, GREEDY, use_tqdm=False))[0] for p in PROMPTS] == plain_outputs["batch1"]
        assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == plain_outputs["batch4"]
        stats = llm.llm_engine.spec_stats
        assert stats.num_steps > 0 and stats.mean_accepted_length >= 1.0
        if draft == "same":
            assert stats.mean_accepted_length > 1 + 0.5 * K
        if worker:
            overlap = llm.llm_engine.proposer.stats()
            assert overlap["faults"] == 0 and overlap["hidden_s"] > 0
            if draft == "same":
                assert overlap["predraft_hits"] > 0 and overlap["overlap_share"] > 0
    finally:
        _close(llm)


def test_killed_worker_loses_no_request_and_is_restarted(tiny_llama_dir, plain_outputs):
    llm = _worker_llm(tiny_llama_dir)
    engine, proposer = llm.llm_engine, llm.llm_engine.proposer
    try:
        first_pid = proposer.worker_pid
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(str(i), prompt, GREEDY)
        finished, steps = {}, 0
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = list(output.outputs[0].token_ids)
            steps += 1
            if steps == 3:
                assert engine.spec_stats.num_steps > 0  # the worker was drafting when it died
                os.kill(first_pid, signal.SIGKILL)
        assert [finished[str(i)] for i in range(len(PROMPTS))] == plain_outputs["batch4"]
        assert proposer.faults == 1 and proposer.restarts == 1

        deadline = time.monotonic() + 60
        while not proposer.poll_ready():
            assert time.monotonic() < deadline, "the draft worker did not come back"
            time.sleep(0.1)
        assert proposer.worker_pid != first_pid
        accepted_before = engine.spec_stats.num_accepted_tokens
        assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == plain_outputs["batch4"]
        assert engine.spec_stats.num_accepted_tokens > accepted_before  # the new worker drafts again
        # /metrics: the workers' counters, the dead one's included, and the restart.
        samples = _metric_samples(engine)
        stats = proposer.stats()
        assert samples["hetero:cpu_draft_worker_restarts_total"] == samples["hetero:cpu_draft_worker_faults_total"] == 1
        for name, key in [("hidden_seconds", "hidden_s"), ("exposed_seconds", "exposed_s"),
                          ("predraft_hits", "predraft_hits"), ("predraft_misses", "predraft_misses"),
                          ("ahead_seconds", "ahead_s"), ("ahead_levels", "ahead_levels")]:
            assert samples[f"hetero:cpu_draft_{name}_total"] == pytest.approx(stats[key])
        assert samples["hetero:cpu_draft_exposed_seconds_total"] > 0
        assert samples["hetero:spec_decode_draft_wait_seconds_total"] == pytest.approx(engine.draft_wait_seconds)
        assert engine.draft_wait_seconds > 0
        assert samples["hetero:spec_decode_unready_steps_total"] == engine.num_unready_steps
    finally:
        _close(llm)


def _metric_samples(engine) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    from hetero.metrics import ServerMetrics, snapshot_engine

    metrics = ServerMetrics("tiny")
    metrics.on_snapshot(snapshot_engine(engine))
    return {sample.name: sample.value for family in text_string_to_metric_families(metrics.render().decode())
            for sample in family.samples}


def test_hung_worker_times_out_and_is_replaced(tiny_llama_dir, plain_outputs, monkeypatch):
    monkeypatch.setenv("HETERO_DRAFT_REPLY_TIMEOUT_S", "1")
    llm = _worker_llm(tiny_llama_dir)
    proposer = llm.llm_engine.proposer
    hung_pid = proposer.worker_pid
    os.kill(hung_pid, signal.SIGSTOP)  # alive, but never answers
    try:
        assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == plain_outputs["batch4"]
        assert proposer.faults == 1 and proposer.restarts == 1 and proposer.worker_pid != hung_pid
    finally:
        _close(llm)


def test_a_stalled_worker_is_not_waited_for_and_drafts_again_after(tiny_llama_dir, plain_outputs):
    """A worker that stops answering for a while (its cores taken) is answered for with empty
    trees after a few steps' wait, so the engine decodes a token a step meanwhile; its late
    reply is dropped, it is not restarted, and it drafts again once it runs."""
    llm = _worker_llm(tiny_llama_dir)
    engine, proposer = llm.llm_engine, llm.llm_engine.proposer
    try:
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
        finished = {}

        def step():
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = list(output.outputs[0].token_ids)

        while engine.spec_stats.num_steps < 4 * len(PROMPTS):
            step()  # speculating, and the engine's step time measured
        os.kill(proposer.worker_pid, signal.SIGSTOP)
        try:
            tokens = engine.num_generation_tokens_total
            for _ in range(3):
                step()
            assert engine.num_generation_tokens_total > tokens  # decoded while the worker was stopped
            assert proposer.late_replies >= 2
        finally:
            os.kill(proposer.worker_pid, signal.SIGCONT)
        accepted = engine.spec_stats.num_accepted_tokens
        while engine.has_unfinished_requests():
            step()
        assert [finished[str(i)][:20] for i in range(len(PROMPTS))] == plain_outputs["batch4"]
        assert proposer.faults == 0 and proposer.restarts == 0
        assert engine.spec_stats.num_accepted_tokens > accepted  # drafting again
        assert _metric_samples(engine)["hetero:cpu_draft_late_replies_total"] == proposer.late_replies
    finally:
        _close(llm)


# ------------------------------------------------------------------ errors
def test_vocabulary_size_mismatch_is_a_clear_error(tiny_llama_dir, tmp_path):
    from tiny_models import build_tokenizer

    bigger = save_tiny_model(tmp_path / "bigger", "llama", vocab_size=len(build_tokenizer()) + 8)
    with pytest.raises(ValueError, match="vocabulary of .* tokens but the target model has"):
        LLM(device="cpu", model=str(tiny_llama_dir), speculative_model=str(bigger), num_speculative_tokens=K, dtype="float32")


def test_tokenizer_mismatch_is_a_clear_error(tiny_llama_dir, tmp_path):
    shuffled = save_tiny_model(tmp_path / "shuffled", "llama")
    tokenizer_file = shuffled / "tokenizer.json"
    data = json.loads(tokenizer_file.read_text())
    vocab = data["model"]["vocab"]
    first, second = [t for t, i in vocab.items() if i in (100, 200)]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    tokenizer_file.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="tokenizer maps id 100"):
        LLM(device="cpu", model=str(tiny_llama_dir), speculative_model=str(shuffled), num_speculative_tokens=K, cpu_draft_worker=True)


def test_draft_dtype_knob_defaults_to_auto_and_names_a_bad_value(monkeypatch):
    from cpu_draft.proposer import cpu_dtype
    from hetero.core.config import EngineConfig

    def draft_dtype(**kwargs):
        return cpu_dtype(EngineConfig(model="m", speculative_model="d", **kwargs).draft.dtype)

    monkeypatch.delenv("HETERO_DRAFT_DTYPE", raising=False)
    assert draft_dtype() is None
    assert draft_dtype(speculative_config={"dtype": "auto"}) is None
    assert draft_dtype(speculative_config={"dtype": "bfloat16"}) == torch.bfloat16
    assert draft_dtype(speculative_config={"dtype": "float32"}) == torch.float32
    monkeypatch.setenv("HETERO_DRAFT_DTYPE", "bfloat16")
    assert draft_dtype() == torch.bfloat16
    with pytest.raises(ValueError, match=r"speculative_config\.dtype \(\$HETERO_DRAFT_DTYPE\)"):
        draft_dtype(speculative_config={"dtype": "int4"})


@pytest.mark.parametrize("available", [True, False])
def test_auto_draft_dtype_is_bf16_where_the_native_forward_builds(monkeypatch, caplog, available):
    from cpu_draft import native, proposer

    monkeypatch.setattr(native, "available", lambda: available)
    monkeypatch.setattr(proposer, "_logged_auto_dtype", None)
    want = torch.bfloat16 if available else torch.float32
    with caplog.at_level(logging.INFO, logger="hetero.cpu_draft"):
        assert proposer.resolve_cpu_dtype(None) == want
        assert proposer.resolve_cpu_dtype(None) == want
    assert len([r for r in caplog.records if "draft_dtype auto" in r.getMessage()]) == 1  # logged once
    for explicit in (torch.float32, torch.bfloat16):  # an explicit dtype is kept whatever builds
        assert proposer.resolve_cpu_dtype(explicit) == explicit


