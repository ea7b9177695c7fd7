import math
from collections import Counter, defaultdict

import numpy as np
import pytest
import torch

from gpu_target.sampler import (
    RowContext,
    no_repeat_ngram_bans,
    raw_logprobs,
    sample,
    target_probs,
    verify_tree,
)
from hetero.core.protocols import TokenTree
from hetero.core.sampling_params import SamplingParams


def row(prompt=(), output=(), eos=(), generator=None, **params):
    return RowContext(SamplingParams(**params), list(prompt), list(output), list(eos), generator)


def probs_of(logits, **params):
    ctx = row(**params)
    return target_probs(torch.tensor([logits], dtype=torch.float32), [ctx])[0]


def chi2_pvalue(observed, expected_probs) -> float:
    """Pearson chi-square goodness of fit.

    Bins are merged, smallest expectation first, until each expects at least 5 counts
    (below that the chi-square approximation overstates significance). A count in a
    zero-probability bin is an outright failure (p = 0).
    """
    observed = np.asarray(observed, dtype=np.float64)
    expected_probs = np.asarray(expected_probs, dtype=np.float64)
    if observed[expected_probs == 0].sum() > 0:
        return 0.0
    expected = expected_probs / expected_probs.sum() * observed.sum()
    obs_bins, exp_bins = [], []
    obs_acc = exp_acc = 0.0
    for i in np.argsort(expected):
        if expected[i] == 0:
            continue
        obs_acc, exp_acc = obs_acc + observed[i], exp_acc + expected[i]
        if exp_acc >= 5:
            obs_bins.append(obs_acc)
            exp_bins.append(exp_acc)
            obs_acc = exp_acc = 0.0
    if exp_acc > 0 and exp_bins:  # a small remainder joins the last (largest) bin
        obs_bins[-1] += obs_acc
        exp_bins[-1] += exp_acc
    dof = len(obs_bins) - 1
    if dof < 1:
        return 1.0
    obs_bins, exp_bins = np.array(obs_bins), np.array(exp_bins)
    stat = float(((obs_bins - exp_bins) ** 2 / exp_bins).sum())
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def test_chi2_pvalue_matches_known_values():
    # chi-square survival function: dof 1 at 3.841 and dof 4 at 9.488 are the 5 % points.
    assert chi2_pvalue([1000 + 31, 1000 - 31], [0.5, 0.5]) == pytest.approx(0.165, abs=2e-3)
    assert chi2_pvalue([100, 0], [1.0, 0.0]) == 1.0
    assert chi2_pvalue([99, 1], [1.0, 0.0]) == 0.0
    stat_p = float(torch.special.gammaincc(torch.tensor(2.0, dtype=torch.float64),
                                           torch.tensor(9.488 / 2, dtype=torch.float64)))
    assert stat_p == pytest.approx(0.05, abs=1e-3)


# ---------------------------------------------------------------- processors


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    early = probs_of([0.0] * 6, output=[1], eos=[5], min_tokens=2, stop_token_ids=[2])
    assert torch.allclose(early, torch.tensor([0.25, 0.25, 0, 0.25, 0.25, 0]))
    reached = probs_of([0.0] * 6, output=[1, 1], eos=[5], min_tokens=2, stop_token_ids=[2])
    assert torch.allclose(reached, torch.full((6,), 1 / 6))
    # ignore_eos does not lift the min_tokens ban (vLLM bans all stop ids below min_tokens).
    ignoring = probs_of([0.0] * 4, output=[], eos=[3], min_tokens=1, ignore_eos=True)
    assert ignoring[3] == 0


def test_no_repeat_ngram_matches_transformers():
    from transformers.generation.logits_process import NoRepeatNGramLogitsProcessor

    rng = np.random.default_rng(0)
    vocab = 7
    for trial in range(40):
        size = int(rng.integers(1, 5))
        length = int(rng.integers(0, 25))
        seq = rng.integers(0, 4, size=length).tolist()
        prompt_len = int(rng.integers(0, length + 1))
        logits = torch.tensor(rng.normal(size=vocab), dtype=torch.float32)
        ours = target_probs(logits[None], [row(seq[:prompt_len], seq[prompt_len:], no_repeat_ngram_size=size)])[0]
        if length == 0:
            expected_logits = logits[None].clone()
        else:
            expected_logits = NoRepeatNGramLogitsProcessor(size)(torch.tensor([seq]), logits[None].clone())
        assert torch.allclose(ours, expected_logits.softmax(-1)[0]), (trial, seq, size)
    assert no_repeat_ngram_bans([1, 2, 3, 1, 2], 3).tolist() == [3]
    assert no_repeat_ngram_bans([1, 2, 3, 1, 2], 1).tolist() == [1, 2, 3]


def test_repetition_penalty_matches_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    rng = np.random.default_rng(1)
    logits = torch.tensor(rng.normal(size=(1, 9)) * 3, dtype=torch.float32)
    prompt, output = [0, 3, 3], [5, 8]
    for penalty in (0.5, 1.3, 2.0):
        ours = target_probs(logits, [row(prompt, output, repetition_penalty=penalty)])[0]
        expected = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([prompt + output]), logits.clone())
        assert torch.allclose(ours, expected.softmax(-1)[0])


def test_presence_and_frequency_penalties_count_output_only():
    probs = probs_of([0.0] * 5, prompt=[4], output=[1, 1, 3], frequency_penalty=0.5, presence_penalty=0.25)
    expected = torch.tensor([0.0, -1.25, 0.0, -0.75, 0.0]).softmax(-1)
    assert torch.allclose(probs, expected)


def test_temperature_scales_logits():
    probs = probs_of([0.0, math.log(2.0)], temperature=0.5)
    assert torch.allclose(probs, torch.tensor([0.2, 0.8]))


def test_top_k_keeps_ties_and_ignores_k_beyond_vocab():
    logits = [1.0, 2.0, 3.0, 4.0, 4.0]
    assert torch.allclose(probs_of(logits, top_k=2), torch.tensor([0, 0, 0, 0.5, 0.5]))
    kept = torch.tensor(logits[2:]).softmax(-1)
    assert torch.allclose(probs_of(logits, top_k=3), torch.cat([torch.zeros(2), kept]))
    full = torch.tensor(logits).softmax(-1)
    for disabled in (0, -1, 5, 50):
        assert torch.allclose(probs_of(logits, top_k=disabled), full)


def test_top_p_keeps_smallest_set_reaching_p():
    logits = torch.tensor([0.1, 0.2, 0.3, 0.4]).log().tolist()
    assert torch.allclose(probs_of(logits, top_p=0.45), torch.tensor([0, 0, 3 / 7, 4 / 7]))
    assert torch.allclose(probs_of(logits, top_p=0.35), torch.tensor([0.0, 0, 0, 1]))
    assert torch.allclose(probs_of(logits, top_p=0.05), torch.tensor([0.0, 0, 0, 1]))


def test_min_p_applies_to_the_tempered_distribution():
    logits = torch.tensor([0.1, 0.2, 0.3, 0.4]).log().tolist()
    # T=0.5 squares the probabilities: [.01, .04, .09, .16] / .30; 0.3 * .16 = .048 drops .04.
    assert torch.allclose(probs_of(logits, temperature=0.5, min_p=0.3), torch.tensor([0, 0, 0.09 / 0.25, 0.16 / 0.25]))
    # At T=1 the threshold is 0.3 * 0.4 = 0.12 and 0.2 survives.
    assert torch.allclose(probs_of(logits, min_p=0.3), torch.tensor([0, 0.2 / 0.9, 0.3 / 0.9, 0.4 / 0.9]))


def test_top_k_then_top_p_then_min_p_compose_in_order():
    logits = torch.tensor([0.05, 0.1, 0.15, 0.3, 0.4]).log().tolist()
    # top_k=4 -> [.1,.15,.3,.4]/.95; top_p=0.8 keeps .4,.3,.15 (0.7/.95 < .8); min_p=0.45 drops .15 (< .18).
    probs = probs_of(logits, top_k=4, top_p=0.8, min_p=0.45)
    assert torch.allclose(probs, torch.tensor([0, 0, 0, 3 / 7, 4 / 7]))


def test_greedy_row_is_one_hot_at_penalised_argmax():
    probs = probs_of([3.0, 2.9, 0.0], output=[0], temperature=0.0, repetition_penalty=1.2)
    assert probs.tolist() == [0.0, 1.0, 0.0]


def test_batch_equals_rows_processed_alone():
    rng = np.random.default_rng(2)
    vocab = 12
    contexts = [
        row([1, 2, 3], [2, 2], eos=[0], temperature=0.7, top_k=4, repetition_penalty=1.3),
        row([5], [], eos=[0], min_tokens=2, top_p=0.6, frequency_penalty=0.4),
        row([1, 2, 1], [2], eos=[0], temperature=0.0, no_repeat_ngram_size=2),
        row([7, 8], [9, 9, 9], eos=[0], min_p=0.2, presence_penalty=-0.5, temperature=1.5),
        row([7, 8], [9, 9, 9], eos=[0], min_p=0.2, presence_penalty=-0.5, temperature=1.5),
        row([], [3], eos=[0]),
    ]
    logits = torch.tensor(rng.normal(size=(len(contexts), vocab)) * 2, dtype=torch.float32)
    original = logits.clone()
    batch = target_probs(logits, contexts)
    assert torch.equal(logits, original), "target_probs must not modify its input"
    for i, ctx in enumerate(contexts):
        alone = target_probs(logits[i:i + 1], [ctx])[0]
        assert torch.allclose(batch[i], alone, atol=1e-6)
        assert torch.allclose(batch[i].sum(), torch.tensor(1.0))


# ---------------------------------------------------------------- sampling


def test_sample_follows_the_distribution():
    p = torch.tensor([0.5, 0.0, 0.2, 0.3])
    n = 20000
    probs = p.expand(n, -1).contiguous()
    torch.manual_seed(0)
    tokens = sample(probs, [row()] * n)
    counts = np.bincount(tokens.numpy(), minlength=4)
    assert chi2_pvalue(counts, p.numpy()) > 0.01


def test_greedy_rows_take_argmax():
    probs = torch.tensor([[0.1, 0.6, 0.3], [0.5, 0.2, 0.3]])
    tokens = sample(probs, [row(temperature=0.0), row(temperature=0.0, seed=3,
                                                       generator=torch.Generator().manual_seed(3))])
    assert tokens.tolist() == [1, 0]


def test_seeded_rows_reproduce_whatever_the_batch():
    vocab = 50
    probs = torch.softmax(torch.randn(3, vocab, generator=torch.Generator().manual_seed(5)), -1)

    def draws(order, steps=6):
        gens = {name: torch.Generator().manual_seed(seed) for name, seed in (("a", 11), ("b", 12))}
        contexts = {"a": row(seed=11, generator=gens["a"]), "b": row(seed=12, generator=gens["b"]), "c": row()}
        index = {"a": 0, "b": 1, "c": 2}
        out = defaultdict(list)
        for _ in range(steps):
            batch = torch.stack([probs[index[name]] for name in order])
            tokens = sample(batch, [contexts[name] for name in order]).tolist()
            for name, token in zip(order, tokens):
                out[name].append(token)
        return out

    alone_a, alone_b = draws(["a"])["a"], draws(["b"])["b"]
    for order in (["a", "b", "c"], ["c", "b", "a"], ["c", "a", "c"], ["b", "c"]):
        out = draws(order)
        if "a" in order:
            assert out["a"] == alone_a
        if "b" in order:
            assert out["b"] == alone_b
    assert len(set(alone_a)) > 1  # genuinely random, not a constant


# ---------------------------------------------------------------- logprobs


def test_raw_logprobs_reports_chosen_and_top_tokens_with_ranks():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 1.0]])
    reference = torch.log_softmax(logits, -1)
    out = raw_logprobs(logits, torch.tensor([3, 2]), [2, 0])
    assert set(out[0]) == {3, 1, 2}
    assert out[0][1] == pytest.approx((reference[0, 1].item(), 1))
    assert out[0][2] == pytest.approx((reference[0, 2].item(), 2))
    assert out[0][3] == pytest.approx((reference[0, 3].item(), 4))
    assert out[1] == {2: pytest.approx((reference[1, 2].item(), 1))}
    everything = raw_logprobs(logits[:1], torch.tensor([0]), [-1])[0]
    assert sorted(everything) == [0, 1, 2, 3]
    assert [everything[t][1] for t in (1, 2, 0, 3)] == [1, 2, 3, 4]


# ---------------------------------------------------------------- greedy tree verification


def one_hot_rows(argmaxes, vocab=8):
    return torch.nn.functional.one_hot(torch.tensor(argmaxes), vocab).float()


def test_greedy_chain_all_right_all_wrong_and_partial():
    tree = TokenTree.chain([3, 1, 4])
    assert verify_tree(one_hot_rows([3, 1, 4, 6]), tree, True, None) == ([0, 1, 2], 6)
    assert verify_tree(one_hot_rows([5, 1, 4, 6]), tree, True, None) == ([], 5)
    assert verify_tree(one_hot_rows([3, 1, 2, 6]), tree, True, None) == ([0, 1], 2)


def test_greedy_takes_the_longest_matching_path():
    #      root
    #    /   |   \
    #   2(0) 2(1) 5(2)
    #   |     |
    #  7(3)  1(4)
    #         |
    #        3(5)
    tree = TokenTree([2, 2, 5, 7, 1, 3], [-1, -1, -1, 0, 1, 4])
    # rows: root, after 0, after 1, after 2, after 3, after 4, after 5
    probs = one_hot_rows([2, 0, 1, 0, 0, 3, 6])
    assert verify_tree(probs, tree, True, None) == ([1, 4, 5], 6)


def test_greedy_empty_tree_gives_the_root_argmax():
    assert verify_tree(one_hot_rows([4]), TokenTree.empty(), True, None) == ([], 4)


# ---------------------------------------------------------------- lossless tree verification


def rejection_walk(probs, tree, generator, renormalise=True, residual_bonus=True, accept_always=False):
    """A slow reference for the acceptance rule, with switches that break it on purpose."""
    kids = defaultdict(list)
    for node, parent in enumerate(tree.parents.tolist()):
        kids[parent + 1].append(node)
    accepted, row_index = [], 0
    while True:
        p = probs[row_index].double().clone()
        chosen = None
        for node in kids[row_index]:
            x = int(tree.tokens[node])
            mass = p.sum() if renormalise else 1.0
            u = torch.rand((), generator=generator, dtype=torch.float64)
            if accept_always or u * mass < p[x]:
                chosen = node
                break
            p[x] = 0.0
        if chosen is None:
            final = p if residual_bonus else probs[row_index].double()
            return accepted, int(torch.multinomial(final, 1, generator=generator))
        accepted.append(chosen)
        row_index = chosen + 1


def random_distribution(rng, vocab, zero_fraction):
    weights = rng.gamma(0.7, size=vocab)
    zeroed = rng.random(vocab) < zero_fraction
    if zero_fraction > 0:
        zeroed[rng.integers(vocab)] = True  # at least one impossible token
    weights[zeroed] = 0.0
    if weights.sum() == 0:
        weights[rng.integers(vocab)] = 1.0
    return weights / weights.sum()


class TargetModel:
    """Distributions that depend only on the token path, as a real model's do: duplicate
    siblings (same path) get the same row."""

    def __init__(self, rng, vocab, zero_fraction):
        self.rng, self.vocab, self.zero_fraction = rng, vocab, zero_fraction
        self.rows = {}

    def dist(self, path):
        path = tuple(path)
        if path not in self.rows:
            self.rows[path] = random_distribution(self.rng, self.vocab, self.zero_fraction)
        return self.rows[path]

    def probs_for(self, tree):
        paths = [()] + [tuple(int(tree.tokens[i]) for i in tree.path_to(n)) for n in range(len(tree))]
        return torch.tensor(np.stack([self.dist(p) for p in paths]), dtype=torch.float32)

    def likely(self, path):
        return int(np.argmax(self.dist(path)))

    def impossible(self, path):
        zeros = np.flatnonzero(self.dist(path) == 0)
        return int(zeros[0]) if len(zeros) else None


def build_tree(kind, model, rng):
    vocab = model.vocab
    if kind == "chain":
        return TokenTree.chain(rng.integers(0, vocab, size=4).tolist())
    if kind == "likely_chain":  # deep acceptance: each token the row's mode
        tokens = []
        for _ in range(6):
            tokens.append(model.likely(tokens))
        return TokenTree.chain(tokens)
    if kind == "wide":
        return TokenTree(rng.permutation(vocab)[:5], [-1] * 5)
    if kind == "wide_likely":  # the root's four most likely tokens, a duplicate, and a likely child each
        top = np.argsort(-model.dist(()))[:4].tolist()
        return TokenTree(top + [top[0]] + [model.likely((t,)) for t in top], [-1] * 5 + [0, 1, 2, 3])
    if kind == "duplicates":
        a, b = model.likely(()), int(rng.integers(vocab))
        # root -> a, a, b, a ; children below both copies of a and below b
        c, d = model.likely((a,)), int(rng.integers(vocab))
        return TokenTree([a, a, b, a, c, d, c, d, c], [-1, -1, -1, -1, 0, 1, 1, 2, 4])
    if kind == "zero_probability":
        dead = model.impossible(())
        alive = model.likely(())
        below = model.impossible((alive,))
        tokens = [dead, alive, dead, below, model.likely((alive,))]
        return TokenTree(tokens, [-1, -1, -1, 1, 1])
    if kind == "random":
        n = 12
        parents = [-1] + [int(rng.integers(-1, i)) for i in range(1, n)]
        tokens = []
        for i, parent in enumerate(parents):
            path = [] if parent < 0 else [tokens[j] for j in TokenTree(tokens[:parent + 1], parents[:parent + 1]).path_to(parent)]
            tokens.append(model.likely(path) if rng.random() < 0.75 else int(rng.integers(vocab)))
        return TokenTree(tokens, parents)
    raise ValueError(kind)


def emission_pvalues(verify, model, tree, num_runs, seed):
    """For each emitted-token prefix seen often enough, the chi-square p-value of the next
    emitted token against the target's row for that prefix (prefix () = the root)."""
    probs = model.probs_for(tree)
    generator = torch.Generator().manual_seed(seed)
    counts = defaultdict(Counter)
    tokens = tree.tokens.tolist()
    for _ in range(num_runs):
        path, bonus = verify(probs, tree, generator)
        emitted = [tokens[i] for i in path] + [bonus]
        for k, token in enumerate(emitted):
            counts[tuple(emitted[:k])][token] += 1
    pvalues = {}
    for prefix, counter in counts.items():
        if sum(counter.values()) >= 300:
            observed = [counter[t] for t in range(model.vocab)]
            pvalues[prefix] = chi2_pvalue(observed, model.dist(prefix))
    return pvalues


TREE_KINDS = ["chain", "likely_chain", "wide", "wide_likely", "duplicates", "zero_probability", "random"]


def real_verify(probs, tree, generator):
    return verify_tree(probs, tree, False, generator)


@pytest.mark.parametrize("kind", TREE_KINDS)
def test_tree_rejection_sampling_is_lossless(kind):
    rng = np.random.default_rng(TREE_KINDS.index(kind) + 100)
    vocab = int(rng.integers(6, 11))
    model = TargetModel(rng, vocab, zero_fraction=0.3)
    tree = build_tree(kind, model, rng)
    pvalues = emission_pvalues(real_verify, model, tree, num_runs=8000, seed=7)
    assert () in pvalues
    if kind in ("likely_chain", "duplicates", "zero_probability"):
        assert any(len(prefix) >= 2 for prefix in pvalues), "the test must reach below the first level"
    if kind in ("wide", "wide_likely", "random"):
        assert len(pvalues) >= 2
    worst = min(pvalues.values()) * len(pvalues)  # Bonferroni over the prefixes tested
    assert worst > 0.01, {k: v for k, v in pvalues.items() if v * len(pvalues) <= 0.01}


BROKEN_RULES = {
    "accept_always": dict(accept_always=True),
    "no_renormalisation": dict(renormalise=False),
    "bonus_from_full_row": dict(residual_bonus=False),
}


def test_reference_walk_is_itself_lossless():
    rng = np.random.default_rng(200)
    model = TargetModel(rng, 8, zero_fraction=0.2)
    tree = build_tree("wide_likely", model, rng)
    pvalues = emission_pvalues(rejection_walk, model, tree, num_runs=6000, seed=3)
    assert min(pvalues.values()) * len(pvalues) > 0.01


@pytest.mark.parametrize("rule", list(BROKEN_RULES))
def test_broken_acceptance_rules_fail_the_same_check(rule):
    rng = np.random.default_rng(200)
    model = TargetModel(rng, 8, zero_fraction=0.2)
    tree = build_tree("wide_likely", model, rng)

    def broken(probs, tree, generator):
        return rejection_walk(probs, tree, generator, **BROKEN_RULES[rule])

    pvalues = emission_pvalues(broken, model, tree, num_runs=6000, seed=3)
    assert min(pvalues.values()) * len(pvalues) < 0.01


def test_zero_probability_drafts_are_never_accepted():
    probs = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.25] * 4, [0.25] * 4])
    tree = TokenTree([0, 3], [-1, -1])
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        path, bonus = verify_tree(probs, tree, False, generator)
        assert path == [] and bonus in (1, 2)


def test_one_hot_rows_under_sampling_accept_like_greedy():
    tree = TokenTree.chain([3, 1, 4])
    probs = one_hot_rows([3, 1, 2, 6])
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        assert verify_tree(probs, tree, False, generator) == ([0, 1], 2)


def test_all_rejected_bonus_avoids_every_rejected_token():
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]] + [[0.25] * 4] * 2)
    tree = TokenTree([0, 1], [-1, -1])
    generator = torch.Generator().manual_seed(1)
    seen_bonus = set()
    for _ in range(500):
        path, bonus = verify_tree(probs, tree, False, generator)
        if not path:
            seen_bonus.add(bonus)
    assert seen_bonus == {2, 3}


def test_seeded_verification_replays_and_empty_tree_samples_root():
    rng = np.random.default_rng(3)
    model = TargetModel(rng, 9, zero_fraction=0.0)
    tree = build_tree("random", model, rng)
    probs = model.probs_for(tree)

    def run(seed):
        generator = torch.Generator().manual_seed(seed)
        return [verify_tree(probs, tree, False, generator) for _ in range(30)]

    assert run(5) == run(5)
    assert run(5) != run(6)
    root = torch.tensor([[0.0, 0.0, 1.0]])
    assert verify_tree(root, TokenTree.empty(), False, torch.Generator().manual_seed(0)) == ([], 2)
    with pytest.raises(ValueError, match="rows"):
        verify_tree(probs[:2], tree, False, None)
