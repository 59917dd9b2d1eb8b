"""The datastore (retrieval drafting): its index against a brute-force search, its file,
its errors, and the shipped one."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from specdec import CompositeDrafter, Datastore, DatastoreDrafter, load_datastore
from specdec.datastore import MAX_HITS, MAX_NGRAM, MIN_NGRAM
from specdec.sampling import SamplingParams
from tiny import needs_model

GREEDY = SamplingParams(temperature=0.0)


def brute_force(seqs, ids, k):
    """What the store should propose, by scanning every sequence."""
    for n in range(min(MAX_NGRAM, len(ids)), MIN_NGRAM - 1, -1):
        gram = list(ids[-n:])
        # every occurrence, in the order the index keeps them: by the tokens that follow
        # (up to MAX_NGRAM from the start; the gap after a sequence sorts after every token)
        hits = [(s, i) for s in seqs for i in range(len(s) - n + 1) if list(s[i: i + n]) == gram]
        if not hits:
            continue
        assert len(hits) <= MAX_HITS  # (the tests keep under the vote's cap)
        out, live = [], [(s, i + n) for s, i in hits]
        for _ in range(k):
            nxt = Counter(int(s[j]) for s, j in live if j < len(s))
            if not nxt:
                break
            best = min(nxt, key=lambda t: (-nxt[t], t))
            out.append(best)
            live = [(s, j + 1) for s, j in live if j < len(s) and s[j] == best]
        return n, out
    return None, []


@pytest.mark.parametrize("vocab", [5, 50, 70000])  # 16 bits a token (4 to a word), and 17 (3 to a word)
def test_the_index_finds_what_a_scan_finds(vocab):
    rng = np.random.default_rng(vocab)
    alphabet = rng.choice(vocab, size=4, replace=False)  # few distinct tokens: long repeated n-grams
    seqs = [alphabet[rng.integers(0, 4, size=rng.integers(1, 40))] for _ in range(12)]
    store = Datastore(seqs, vocab)
    assert len(store) == sum(map(len, seqs))
    checked = Counter()
    for _ in range(300):
        ids = list(alphabet[rng.integers(0, 4, size=rng.integers(1, 12))])
        n, want = brute_force(seqs, ids, k=5)
        found = store.match(ids)
        assert (found[0] if found else None) == n, ids
        got = store.continuation(found, 5) if found else []
        assert got == want, ids
        checked[n] += 1
    assert checked[None] and checked[2] and sum(v for n, v in checked.items() if n and n >= 5)  # all kinds seen


def test_the_vote_samples_the_whole_range_of_a_frequent_suffix():
    # More occurrences than the vote reads: 200 write 3 after (1, 2), 400 write 9. The
    # occurrences sit in the order of what follows them (all 3s first), so reading the first
    # MAX_HITS of them would vote for 3.
    assert 200 < MAX_HITS < 600
    store = Datastore([[1, 2, 3]] * 200 + [[1, 2, 9]] * 400, 10)
    assert store.continuation(store.match([1, 2]), 1) == [9]


def test_no_match_crosses_from_one_sequence_into_the_next():
    store = Datastore([[1, 2, 3], [4, 5, 6]], 10)
    assert store.match([3, 4]) is None  # 3 ends one sequence, 4 starts the next
    assert store.continuation(store.match([2, 3]), 4) == []  # nothing after 3 in its own sequence
    assert store.continuation(store.match([4, 5]), 4) == [6]


def test_the_drafter_proposes_the_continuation_and_names_its_match_length():
    drafter = DatastoreDrafter(Datastore([[1, 2, 3, 4, 5, 6], [9, 2, 3, 4, 7]], 10))
    drafter.begin(100)
    ids = [8, 2, 3, 4]
    assert drafter.sources(ids) == ("store3",)
    assert drafter.propose(ids, 2, GREEDY, None) == [5, 6]  # tie between 5 and 7: the smaller id
    assert drafter.sources([8, 8]) == ()
    comp = CompositeDrafter(datastore=drafter)  # lookup first, then the store; no model
    comp.begin(100)
    assert comp.sources([2, 3, 0, 2, 3]) == ("lookup2", "store2")
    assert comp.propose_rows({0: ([2, 3, 0, 2, 3], 2, "store2")}, GREEDY, {0: None}) == {0: [4, 5]}
    assert comp.propose_rows({0: ([2, 3, 0, 2, 3], 2, "lookup2")}, GREEDY, {0: None}) == {0: [0, 2]}


def test_a_datastore_round_trips_through_its_file(tmp_path):
    store = Datastore([[1, 2, 3, 4], [2, 3, 5]], 70000)
    path = store.save(tmp_path / "s.safetensors", recipe="a test")
    back = Datastore.load(path)
    assert back.vocab_size == 70000 and back.tokens.tolist() == store.tokens.tolist()
    assert back.continuation(back.match([2, 3]), 3) == store.continuation(store.match([2, 3]), 3)


def test_bad_datastores_are_refused_with_the_reason(tmp_path):
    from safetensors.numpy import save_file

    with pytest.raises(ValueError, match="no such file"):
        Datastore.load(tmp_path / "missing.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="not a specdec datastore"):
        Datastore.load(tmp_path / "junk.safetensors")
    save_file({"tokens": np.array([1, 2], dtype=np.uint16)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="not a specdec datastore"):
        Datastore.load(tmp_path / "other.safetensors")
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 10\)"):
        Datastore([[1, 2, 10]], 10)
    with pytest.raises(ValueError, match="no tokens"):
        Datastore([[]], 10)
    with pytest.raises(ValueError, match="needs a model draft or a datastore"):
        CompositeDrafter()


@needs_model
def test_the_shipped_datastore_loads_and_drafts_for_the_default_target():
    from specdec import load_tokenizer

    store = load_datastore("smollm2-135m-instruct")
    assert store.vocab_size == 49152 and len(store) > 500_000
    ids = load_tokenizer("smollm2-135m-instruct").encode("Sure! In conclusion, the")
    assert store.match(ids)[0] >= 3  # a phrase the target writes
    window = store.tokens[1000:1000 + MAX_NGRAM].tolist()  # a stretch of its own text
    found = store.match(window)
    assert found[0] == MAX_NGRAM and 1000 in store.order[found[1]: found[2]]


def test_a_row_that_starts_over_looks_up_its_new_prompt_only():
    """A server reuses a row for another request: after prefill(prompts, rows) the composite's
    lookup sees the new sequence, never the old one's tokens, even where both agree at the
    start, the middle and the end of the old one."""
    store = Datastore([[1, 2, 3, 4]], vocab_size=50)
    comp = CompositeDrafter(datastore=store)
    comp.begin(64, 2)
    old = [9, 10, 11, 30, 9, 9, 14, 15, 30, 9]  # "30 9" matches at 3: proposes what follows it
    assert comp.propose(old, 2, SamplingParams(), None, row=1) == [9, 14]
    new = [9, 40, 41, 42, 43, 9, 44, 45, 46, 9]  # agrees with old at 0, 5 and 9
    comp.prefill([new], [1])
    assert comp.propose(new, 2, SamplingParams(), None, row=1) == [44, 45]
