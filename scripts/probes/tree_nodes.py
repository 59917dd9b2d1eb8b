"""How often the datastore's other continuations are right: the extra nodes a tree hangs on
the default's chain, replayed against the target's greedy output.

At each step of the target's greedy output on the 26 held-out prompts (96 tokens), the
default's chain (lookup's 4 tokens where the context matches, else the store's), then the
store's continuations grown onto it best first (`Datastore.tree`, as `tree_size` does) to
--size nodes; walking the target's output through the tree. Counts each extra node (not on
the chain) by the share of the store's voting occurrences that write its path, and how many
of them the target accepted. A node pays where the chance it is accepted beats what its row
costs (`tree_cost.py`: 2-4% of a one-token pass on the AMX VM, at about 2 tokens a pass).

    python3 scripts/probes/tree_nodes.py [--size 15] [--max-tokens 96]
"""
from __future__ import annotations

import argparse
from collections import Counter

import numpy as np
import torch
from tqdm import tqdm

import specdec
from specdec.bench.suite import load_suite, render
from specdec.drafters import find_match

HELDOUT = "specdec/bench/prompts/heldout-specbench-v1.jsonl"


def share_of(store, found, path: list[int]) -> float:
    """The share of the match's voting occurrences (as Datastore.tree samples them) that
    continue with `path`."""
    at = store.voters(found)
    ok = np.ones(len(at), dtype=bool)
    for j, t in enumerate(path):
        ok &= store.tokens[np.minimum(at + j, len(store.tokens) - 1)] == t
    return float(ok.mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=15)
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    torch.set_num_threads(2)
    store = specdec.load_datastore("smollm2-135m-instruct")
    target = specdec.load_model("smollm2-135m-instruct")
    prompts = load_suite(HELDOUT)
    render(prompts, target, target.tokenizer)
    nodes, accepted = Counter(), Counter()
    for p in tqdm(prompts, desc="prompts"):
        out = specdec.generate(target, None, p.ids, args.max_tokens).token_ids
        seq, t = p.ids + out, 1
        while t < len(out):
            ids = seq[: len(p.ids) + t]
            match, found = find_match(np.asarray(ids), 3, 1), store.match(ids)
            chain = ids[match[0]: match[0] + 4] if match else store.continuation(found, 4) if found else []
            tokens, parents = list(chain), list(range(-1, len(chain) - 1))
            if found:
                tokens, parents = store.tree(found, tokens, parents, args.size)
            node, path = -1, set()
            for truth in out[t:]:  # the target's walk through the tree
                node = next((i for i, (tk, pa) in enumerate(zip(tokens, parents)) if pa == node and tk == truth), None)
                if node is None:
                    break
                path.add(node)
            for i in range(len(chain), len(tokens)):
                route, j = [], i
                while j >= 0:
                    route.append(tokens[j])
                    j = parents[j]
                bucket = min(int(share_of(store, found, route[::-1]) * 5), 4)
                nodes[bucket] += 1
                accepted[bucket] += i in path
            t += len(path) + 1
    print(f"the store's extra nodes (trees of {args.size}), {len(prompts)} held-out prompts, {args.max_tokens} tokens:")
    for b in sorted(nodes):
        print(f"  share {b / 5:.1f}-{(b + 1) / 5:.1f}: {nodes[b]:6d} nodes, accepted {accepted[b] / nodes[b]:.3f}")
    total = sum(nodes.values())
    print(f"  all: {total} nodes, accepted {sum(accepted.values()) / total:.3f}")


if __name__ == "__main__":
    main()
