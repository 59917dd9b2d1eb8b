"""Would a tree of the model-free drafts pay? A replay against the target's greedy output.

The default drafts a chain: prompt lookup's continuation where the context's last n-gram
occurs earlier, else the datastore's majority continuation. Both know more than one
continuation: the store holds up to 256 occurrences of the suffix, and they disagree. A tree
verifies several in one pass: the lookup's chain (up to --lookup-k tokens), then the store's
trie of continuations, grown best first by the share of the occurrences that continue with
a node's path (an estimate of the chance the target writes that path), to N nodes in all.

Replayed greedy on the 26 held-out prompts (the target's own output, 96 tokens): tokens per
verification pass, walking each output with a tree of at most N drafted nodes a pass (the
pass holds N + 1 tokens), against the chain (lookup, else the store) of k tokens on the same
walk. Drafting is free in both (lookups). What a pass of N + 1 rows costs is the kernel's
(`kernel_rows.py --all-logits`).

    python3 scripts/probes/tree_replay.py [--budgets 4 8 11 15] [--lookup-k 4 8]
"""
from __future__ import annotations

import argparse
import heapq
from collections import Counter, defaultdict

import numpy as np
import torch
from tqdm import tqdm

import specdec
from specdec.bench.suite import load_suite, render
from specdec.datastore import MAX_HITS
from specdec.drafters import find_match

HELDOUT = "specdec/bench/prompts/heldout-specbench-v1.jsonl"


class Trie:
    """Drafted tokens as a tree: children[node] maps a token to its node (node 0: the root)."""

    def __init__(self):
        self.children: list[dict[int, int]] = [{}]

    def __len__(self) -> int:  # drafted nodes, the root not counted
        return len(self.children) - 1

    def add(self, parent: int, token: int) -> int:
        node = self.children[parent].get(token)
        if node is None:
            node = self.children[parent][token] = len(self.children)
            self.children.append({})
        return node

    def add_path(self, tokens) -> None:
        node = 0
        for t in tokens:
            node = self.add(node, t)

    def accepted(self, truth) -> int:
        """Drafts the target accepts, greedy: the longest path that is a prefix of truth."""
        node = n = 0
        for t in truth:
            node = self.children[node].get(t)
            if node is None:
                break
            n += 1
        return n


def grow_from_store(tree: Trie, store, found, budget: int) -> None:
    """Add the store's continuations of a match, best first, until the tree holds `budget`."""
    n, lo, hi = found
    at = store.order[np.linspace(lo, hi - 1, min(hi - lo, MAX_HITS)).astype(np.int64)] + n
    heap, tick = [], 0

    def push(parent, where):
        nonlocal tick
        nxt = store.tokens[where]
        values, counts = np.unique(nxt[nxt != store.gap], return_counts=True)
        for v, c in zip(values.tolist(), counts.tolist()):
            heapq.heappush(heap, (-c / len(at), tick, parent, v, where[nxt == v] + 1))
            tick += 1

    push(0, at)
    while heap and len(tree) < budget:
        _, _, parent, token, where = heapq.heappop(heap)
        push(tree.add(parent, token), where)


def chains(ids, store, k, both: bool = False) -> Trie:
    """Lookup's chain of up to k where the context matches, else the store's. both: each of
    them, the paths two rows of a batch would verify side by side (a row per chain, each its
    own sequence with the same prefix)."""
    tree = Trie()
    match = find_match(np.asarray(ids), 3, 1)
    if match:
        tree.add_path(ids[match[0]: match[0] + k])
    if (both or not match) and (found := store.match(ids)):
        tree.add_path(store.continuation(found, k))
    return tree


def tree_of(ids, store, budget, lookup_k) -> Trie:
    tree = Trie()
    match = find_match(np.asarray(ids), 3, 1)
    if match:
        tree.add_path(ids[match[0]: match[0] + min(lookup_k, budget)])
    if found := store.match(ids):
        grow_from_store(tree, store, found, budget)
    return tree


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budgets", type=int, nargs="+", default=[4, 8, 11, 15])
    ap.add_argument("--lookup-k", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    torch.set_num_threads(2)
    store = specdec.load_datastore("smollm2-135m-instruct")
    target = specdec.load_model("smollm2-135m-instruct")
    prompts = load_suite(HELDOUT)
    render(prompts, target, target.tokenizer)
    rules = {f"chain, k = {k}": lambda ids, k=k: chains(ids, store, k) for k in (4, 8, 15)}
    for k in (4, 7):
        rules[f"two chains, k = {k}"] = lambda ids, k=k: chains(ids, store, k, both=True)
    for n in args.budgets:
        for lk in args.lookup_k:
            rules[f"tree, N = {n}, lookup {lk}"] = lambda ids, n=n, lk=lk: tree_of(ids, store, n, lk)
    tokens, passes = Counter(), defaultdict(Counter)
    for p in tqdm(prompts, desc="prompts"):
        out = specdec.generate(target, None, p.ids, args.max_tokens).token_ids
        seq = p.ids + out
        for rule, build in rules.items():
            t, count = 1, 0  # the first token comes from the prefill
            while t < len(out):
                t += build(seq[: len(p.ids) + t]).accepted(out[t:]) + 1
                count += 1
            for where in (p.category, "all"):
                passes[rule][where] += count
        for where in (p.category, "all"):
            tokens[where] += len(out) - 1
    wheres = sorted(w for w in tokens if w != "all") + ["all"]
    print(f"tokens per verification pass, {len(prompts)} held-out prompts, {args.max_tokens} tokens:")
    print(f"  {'':26s}" + "".join(f"{w[:10]:>11s}" for w in wheres))
    for rule in rules:
        print(f"  {rule:26s}" + "".join(f"{tokens[w] / passes[rule][w]:11.2f}" for w in wheres))


if __name__ == "__main__":
    main()
