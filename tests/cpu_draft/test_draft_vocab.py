"""The draft's reduced vocabulary (FR-Spec): which ids the head keeps, that drafts map back to
target ids inside that set, and that speculation with such a draft stays lossless."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers

from cpu_draft.draft_vocab import draft_head_ids, load_token_map
from cpu_draft.drafter import DraftModelOptions, Drafter
from hetero import LLM, SamplingParams
from tiny_models import PROMPTS

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
HEAD = 100  # of the tiny models' 320 tokens


# ------------------------------------------------------------------ the id set
def test_no_size_and_no_map_means_the_whole_vocabulary():
    assert draft_head_ids(320, None) is None
    assert draft_head_ids(320, 320) is None  # keeping every id is no reduction
    assert draft_head_ids(320, 500) is None


def test_without_a_map_the_lowest_ids_are_kept_with_the_special_ones():
    ids = draft_head_ids(320, 10, always=[317, 318, 5, 999])
    assert ids.tolist() == list(range(10)) + [317, 318]  # 999 is outside the vocabulary: ignored


@pytest.mark.parametrize("suffix", [".npy", ".json", ".txt", ".pt"])
def test_a_token_map_ranks_the_ids_in_any_of_its_formats(tmp_path, suffix):
    ranked = [42, 7, 42, 300, 1, 99, 7]  # most frequent first; repeats keep their first rank
    path = tmp_path / f"map{suffix}"
    if suffix == ".npy":
        np.save(path, np.asarray(ranked))
    elif suffix == ".json":
        path.write_text(json.dumps(ranked))
    elif suffix == ".txt":
        path.write_text(" ".join(map(str, ranked)) + "\n")
    else:
        torch.save(torch.tensor(ranked), path)
    assert load_token_map(str(path)).tolist() == ranked
    assert draft_head_ids(320, 3, str(path)).tolist() == [7, 42, 300]
    assert draft_head_ids(320, None, str(path)).tolist() == [1, 7, 42, 99, 300]  # the whole map


def test_bad_token_maps_are_refused_with_the_field_named(tmp_path):
    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps([1, 2, 320]))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        draft_head_ids(320, 2, str(outside))
    floats = tmp_path / "floats.json"
    floats.write_text(json.dumps([1.5, 2.0]))
    with pytest.raises(ValueError, match="integer token ids"):
        draft_head_ids(320, 2, str(floats))
    with pytest.raises(ValueError, match="speculative_token_map"):
        draft_head_ids(320, 2, str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="draft_vocab_size"):
        draft_head_ids(320, 0)


def test_engine_config_checks_the_fields(tiny_llama_dir, tmp_path):
    with pytest.raises(ValueError, match="speculative_draft_vocab_size"):
        LLM(model=str(tiny_llama_dir), device="cpu", speculative_model=str(tiny_llama_dir), speculative_draft_vocab_size=0)
    with pytest.raises(ValueError, match="speculative_token_map"):
        LLM(model=str(tiny_llama_dir), device="cpu", speculative_model=str(tiny_llama_dir), speculative_token_map=str(tmp_path / "none"))


# ------------------------------------------------------------------ the drafter
def _reference_chain(model_dir, context: list[int], ids: torch.Tensor, depth: int) -> list[int]:
    """Greedy chain of the HF model whose next token is the argmax over ``ids`` only."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()
    tokens, chain = list(context), []
    with torch.no_grad():
        for _ in range(depth):
            logits = model(torch.tensor([tokens])).logits[0, -1]
            token = int(ids[logits[ids].argmax()])
            chain.append(token)
            tokens.append(token)
    return chain


@pytest.fixture(scope="module")
def token_map(tmp_path_factory):
    """HEAD ids scattered over the vocabulary (ranked at random), so a head column is not its token id."""
    ranked = np.random.default_rng(3).permutation(320)[:HEAD]
    path = tmp_path_factory.mktemp("token-map") / "map.npy"
    np.save(path, ranked)
    return str(path), torch.from_numpy(np.sort(ranked))


@pytest.mark.parametrize("layout, native", [("slots", True), ("slots", False), ("paged", False)])
def test_a_reduced_head_drafts_the_best_token_of_its_set_as_a_target_id(tiny_llama_dir, token_map, layout, native):
    path, ids = token_map
    options = DraftModelOptions(dtype=torch.float32, kv_layout=layout, native_kernels=native, token_map=path, tree_width=2)
    drafter = Drafter.load(str(tiny_llama_dir), options)
    assert torch.equal(drafter.head_ids, ids)
    context = list(range(150, 190))  # the context is not limited to the head's set
    drafter.set_context("s", context)
    tree = drafter.draft([("s", 8)])[0]
    assert set(tree.tokens.tolist()) <= set(ids.tolist())
    chain = drafter.last_chain("s")
    assert chain == _reference_chain(tiny_llama_dir, context, ids, len(chain))
    assert drafter.assume_accepted(["s"]) == ["s"]  # the bonus guess comes from the set too
    assert drafter.context("s")[-1] in set(ids.tolist())


# ------------------------------------------------------------------ end to end
@pytest.fixture(scope="module")
def plain_tokens(tiny_llama_dir):
    llm = LLM(device="cpu", model=str(tiny_llama_dir), dtype="float32")
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("worker", [False, True])
def test_speculation_with_a_reduced_draft_head_is_lossless(tiny_llama_dir, plain_tokens, token_map, worker):
    llm = LLM(device="cpu", model=str(tiny_llama_dir), dtype="float32", speculative_model=str(tiny_llama_dir),
              num_speculative_tokens=4, cpu_draft_worker=worker,
              speculative_config={"draft_vocab_size": HEAD // 2, "speculative_token_map": token_map[0]})
    engine = llm.llm_engine
    engine.spec_control.always_speculate = True
    try:
        outputs = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        if hasattr(engine.proposer, "close"):
            engine.proposer.close()
    assert outputs == plain_tokens
    assert engine.spec_stats.num_accepted_tokens > 0  # the draft is the target: tokens of its set are accepted
