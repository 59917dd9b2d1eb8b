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

from specdec import load_model
from specdec.models import kernel

from test_kernel import COMMON, SHAPES, lib, tiny  # noqa: F401  (fixtures)
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
