"""Trees of candidates verified in one pass (forward_tree / keep_path).

The contract is the kernel's: each row of a tree has the bits of its own path run as a chain
(so, by row invariance, of the one-token pass at the end of that path), and after keep_path
the cache holds the kept path exactly as a chain would have left it. Checked on every form of
the kernel this CPU builds, on tiny models and on the embedded one; the torch path computes
the same to float precision.
"""
from __future__ import annotations

import pytest
import torch

from specdec import load_model, speculative_generate
from specdec.models import kernel

from test_distribution import counting_tree_accept
from test_kernel import SHAPES, lib, tiny  # noqa: F401  (fixtures)
from tiny import needs_model

pytestmark = pytest.mark.skipif(kernel.library() is None, reason="the kernel cannot be built here (no C++ compiler)")


def random_tree(n: int, g: torch.Generator, vocab: int = 64) -> tuple[list[int], list[int]]:
    """n tokens; the first a chain of a few rows (as a drafter's best guess would be), the rest
    hung anywhere earlier."""
    trunk = int(torch.randint(1, n + 1, (1,), generator=g))
    parents = [i - 1 for i in range(trunk)] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(trunk, n)]
    return torch.randint(0, vocab, (n,), generator=g).tolist(), parents


def path_to(parents: list[int], i: int) -> list[int]:
    rows = []
    while i >= 0:
        rows.append(i)
        i = parents[i]
    return rows[::-1]


def as_chain(model, prefix, tokens, parents, i):
    """Logits and K/V of the path to row i, run as a chain after prefix."""
    rows = path_to(parents, i)
    model.reset(len(prefix) + len(tokens))
    model.forward(prefix, last_only=True)
    logits = model.forward([tokens[r] for r in rows])
    n = len(prefix)
    return logits[-1], model.cache.k[:, :, :, n:n + len(rows)].clone(), model.cache.v[:, :, :, n:n + len(rows)].clone()


def assert_tree_rows_are_chains(model, prefix, tokens, parents, exact=True):
    model.reset(len(prefix) + len(tokens))
    model.forward(prefix, last_only=True)
    tree = model.forward_tree(tokens, parents)
    assert model.cache_len == len(prefix) + len(tokens)
    saved = model.cache.k.clone(), model.cache.v.clone()
    for i in range(len(tokens)):
        want, k, v = as_chain(model, prefix, tokens, parents, i)
        if exact:
            assert torch.equal(tree[i], want), f"row {i} of the tree differs from its path: " \
                f"max {(tree[i] - want).abs().max().item()}"
        else:
            assert torch.allclose(tree[i], want, atol=1e-4, rtol=1e-4)
        # keep_path lays the path out as the chain did
        model.cache.k.copy_(saved[0]), model.cache.v.copy_(saved[1])
        model.cache.lengths = [len(prefix) + len(tokens)]
        rows = path_to(parents, i)
        model.keep_path(len(prefix), rows)
        n = len(prefix)
        got_k, got_v = model.cache.k[:, :, :, n:n + len(rows)], model.cache.v[:, :, :, n:n + len(rows)]
        if exact:
            assert torch.equal(got_k, k) and torch.equal(got_v, v), f"keep_path of row {i} left other K/V"
        else:
            assert torch.allclose(got_k, k, atol=1e-5) and torch.allclose(got_v, v, atol=1e-5)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_tree_rows_are_their_paths_bit_for_bit(shape, tiny, lib):  # noqa: F811
    model = load_model(tiny[shape], dtype="bfloat16")
    g = torch.Generator().manual_seed(7 + sorted(SHAPES).index(shape))
    # trees within one attention chunk, across a chunk's end (120 + depth), and more than a
    # tile of queries (the AMX form packs K then)
    for prefix_len, n in [(3, 6), (40, 12), (120, 16), (250, 31)]:
        tokens, parents = random_tree(n, g)
        prefix = torch.randint(0, 64, (prefix_len,), generator=g).tolist()
        assert_tree_rows_are_chains(model, prefix, tokens, parents)


def test_a_chain_given_as_a_tree_is_a_block(tiny, lib):  # noqa: F811
    model = load_model(tiny["gqa-hd32"], dtype="bfloat16")
    prefix, block = list(range(1, 30)), [5, 9, 2, 7, 7, 1]
    model.reset(40)
    model.forward(prefix, last_only=True)
    a = model.forward(block)
    model.rollback(len(prefix))
    b = model.forward_tree(block, [-1, 0, 1, 2, 3, 4])
    assert torch.equal(a, b)


@needs_model
def test_the_embedded_models_tree_rows_are_their_paths(lib):  # noqa: F811
    model = load_model("smollm2-135m-instruct", dtype="bfloat16")
    prefix = model.tokenizer.encode("A tree verifies several guesses at the next tokens in one pass. " * 8)
    tokens, parents = random_tree(15, torch.Generator().manual_seed(3), vocab=model.vocab_size)
    assert_tree_rows_are_chains(model, prefix, tokens, parents)


def test_the_torch_path_computes_the_same_tree(tiny):
    model = load_model(tiny["gqa-hd32"], dtype="float32")  # float32: the torch path
    g = torch.Generator().manual_seed(5)
    tokens, parents = random_tree(10, g)
    assert_tree_rows_are_chains(model, list(range(2, 40)), tokens, parents, exact=False)


def test_bad_trees_are_refused(tiny):
    model = load_model(tiny["gqa-hd32"], dtype="bfloat16")
    model.reset(20)
    model.forward([1, 2, 3])
    for parents in ([0, 0], [-1, 1], [-1, -1], [-1, 0, 3], [-1]):
        with pytest.raises(ValueError, match="parent"):
            model.forward_tree([4, 5] if len(parents) == 2 else [4, 5, 6], parents)
    with pytest.raises(ValueError, match="ascend"):
        model.keep_path(1, [0, 0])
    assert model.cache_len == 3


def test_engines_without_trees_say_so(tiny):
    from transformers import AutoModelForCausalLM

    from specdec.models.base import as_language_model

    hf = as_language_model(AutoModelForCausalLM.from_pretrained(tiny["gqa-hd32"]))
    assert not hf.trees
    with pytest.raises(NotImplementedError, match="chains only"):
        hf.forward_tree([1, 2], [-1, 0])


# ----------------------------------------------------------------------------- decoding with trees


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    from tiny import save_tiny

    return save_tiny(tmp_path_factory.mktemp("tree") / "t", "llama", 0)


@pytest.fixture(scope="module")
def tiny_target(tiny_ckpt):
    return load_model(tiny_ckpt, dtype="float32")  # float32: the torch path's trees


PROMPT = [5, 9, 3, 12, 5, 9, 3, 7]


def own_store(model, n: int = 12, length: int = 40):
    """A datastore of the model's own writing after PROMPT: sampled continuations, which branch
    where it is unsure, and once its greedy one, so that a sibling of the majority is right."""
    from specdec import Datastore, generate

    outs = [generate(model, None, PROMPT, length, temperature=1.5, seed=i).token_ids for i in range(n)]
    return Datastore(outs + [generate(model, None, PROMPT, length).token_ids], model.vocab_size)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("k", [3, "auto"])
def test_caches_consistent_every_tree_step(tiny_target, temperature, k, monkeypatch):
    from specdec import CompositeDrafter, NgramDrafter, generate
    from test_cache import checked_speculative

    from specdec.schedule import AdaptiveK

    seen = counting_tree_accept(monkeypatch)
    # auto grows a tree where its nodes have paid: here, taken to pay from the start
    monkeypatch.setattr(AdaptiveK, "TREE_YIELD", 1.0)
    store = own_store(tiny_target)
    for seed in (3, 4, 5):
        drafter = CompositeDrafter(lookup=NgramDrafter(), datastore=store, tree_size=8)
        res, chunks, _ = checked_speculative(tiny_target, drafter, PROMPT, 40, k, temperature=temperature, seed=seed)
        assert len(res.token_ids) == 40 and len(chunks) == res.stats.target_calls
        if temperature == 0:
            assert res.token_ids == generate(tiny_target, None, PROMPT, 40).token_ids
    assert seen["steps"] > 5, seen  # trees verified
    if k != "auto":  # (few steps branch under auto: off-chain acceptance is not sure to come)
        assert seen["off_chain"] > 0, seen  # and siblings accepted


def test_trees_stop_at_max_tokens_and_eos(tiny_target):
    from specdec import CompositeDrafter, NgramDrafter, generate
    from test_cache import assert_cache_holds, with_eos

    prompt = PROMPT
    store = own_store(tiny_target)
    ref = generate(tiny_target, None, prompt, 12).token_ids
    for max_tokens in range(1, 13):
        drafter = CompositeDrafter(lookup=NgramDrafter(), datastore=store, tree_size=8)
        res = speculative_generate(tiny_target, drafter, None, prompt, max_tokens, num_draft_tokens=4)
        assert res.token_ids == ref[:max_tokens] and res.finish_reason == "length"
        assert_cache_holds(tiny_target, prompt + ref[:max_tokens - 1])
    for i in sorted({ref.index(t) for t in ref})[1:5]:  # an EOS at a token's first appearance
        m = with_eos(tiny_target, ref[i])
        drafter = CompositeDrafter(lookup=NgramDrafter(), datastore=store, tree_size=8)
        res = speculative_generate(m, drafter, None, prompt, 12, num_draft_tokens=4)
        assert res.token_ids == ref[:i + 1] and res.finish_reason == "eos"
        assert_cache_holds(m, prompt + ref[:i])


@needs_model
@pytest.mark.parametrize("prompt", ["Summarize: the committee met on Tuesday and agreed to fund the new library, "
                                    "which opens next spring. Summary:",
                                    "Explain why the sky is blue in two sentences."])
def test_bf16_tree_speculation_is_plain_greedy_exactly(prompt, lib):  # noqa: F811
    from specdec import CompositeDrafter, NgramDrafter, generate, load_datastore

    model = load_model("smollm2-135m-instruct", dtype="bfloat16")
    plain = generate(model, model.tokenizer, prompt, 64, chat=True)
    for k in (4, "auto"):
        drafter = CompositeDrafter(lookup=NgramDrafter(), datastore=load_datastore("smollm2-135m-instruct"),
                                   tree_size=12)
        spec = speculative_generate(model, drafter, model.tokenizer, prompt, 64, num_draft_tokens=k, chat=True)
        assert spec.token_ids == plain.token_ids


def test_tree_options_are_checked(tiny_target):
    from specdec import CompositeDrafter, Datastore, DatastoreDrafter

    store = Datastore([[1, 2, 3]], tiny_target.vocab_size)
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="tree_size"):
            CompositeDrafter(datastore=store, tree_size=bad)
    with pytest.raises(ValueError, match="tree_size"):
        DatastoreDrafter(store, tree_size=-3)
    with pytest.raises(ValueError, match="without a model draft"):
        CompositeDrafter(tiny_target, datastore=store, tree_size=4)


def test_a_tree_on_an_engine_without_trees_is_a_chain(tiny_target, tiny_ckpt):
    from transformers import AutoModelForCausalLM

    from specdec import CompositeDrafter, NgramDrafter, generate
    from specdec.models.base import as_language_model

    hf = as_language_model(AutoModelForCausalLM.from_pretrained(tiny_ckpt))
    prompt = PROMPT
    drafter = CompositeDrafter(lookup=NgramDrafter(), datastore=own_store(tiny_target), tree_size=8)
    res = speculative_generate(hf, drafter, None, prompt, 20)
    assert res.token_ids == generate(hf, None, prompt, 20).token_ids


def test_greedy_tree_acceptance_follows_the_target_argmax_down_the_tree():
    from specdec.sampling import SamplingParams, tree_accept

    # context -> 7 (node 0) -> 8 (node 1); context -> 9 (node 2) -> 4 (node 3), 5 (node 4)
    tokens, parents = [7, 8, 9, 4, 5], [-1, 0, -1, 2, 2]
    logits = torch.zeros(6, 10)
    for row, best in enumerate([9, 1, 2, 5, 3, 6]):  # row 0: the context; row i + 1: after node i
        logits[row, best] = 1.0
    assert tree_accept(tokens, parents, logits, SamplingParams(0.0), None, 0) == ([2, 4], 6)
    logits[0] = 0
    logits[0, 3] = 1.0  # no child is the target's token: nothing accepted
    assert tree_accept(tokens, parents, logits, SamplingParams(0.0), None, 0) == ([], 3)
