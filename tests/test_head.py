"""The hidden-state head: the side outputs of the target's pass, the drafter that reads them,
its file, its training, and the shipped one on the default target."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import specdec
from specdec import CompositeDrafter, Datastore, NgramDrafter, generate, speculative_generate
from specdec.head import HiddenHead, collect, last_hidden, load_head, save_head, target_digest, train_head
from specdec.sampling import SamplingParams
from tiny import needs_model, save_tiny, tiny_hf_model

V, D = 64, 32  # the tiny models' vocabulary and width


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("head")
    save_tiny(root / "target", "llama", 0)
    return specdec.load_model(root / "target", dtype="float32")


def random_weights(seed=0, scale=0.5):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(D, 2 * D, generator=g) * scale, torch.randn(D, generator=g) * scale


def random_head(target, seed=0, scale=0.5):
    weight, bias = random_weights(seed, scale)
    return HiddenHead(target, weight, bias, torch.arange(target.vocab_size, dtype=torch.int32))


def reference_scores(target, weight, bias, prefix, b):
    """score(v) = lm_head[v] . (h + SiLU(W [h; e(b)] + c)), from the hidden state itself."""
    module = target.module
    h = last_hidden(module, prefix)[-1].float()
    z = F.silu(weight.float() @ torch.cat([h, module.model.embed_tokens.weight[b].float()]) + bias.float())
    return module.lm_head.weight.float() @ (h + z)


def observed(target, drafter, prompt):
    """The target's pass over the prompt, with the drafter's side rows, handed to it as the loop does."""
    target.reset(len(prompt) + 8)
    out = target.forward(prompt, side=drafter.side_rows)
    drafter.observe(0, 0, out[:, :V], out[:, V:])


# ----------------------------------------------------------------------------- the engine


def test_side_outputs_follow_the_logits_and_are_the_rows_products_with_the_last_hidden_state(tiny):
    ids = [5, 9, 1, 33, 2, 60, 7]
    side = torch.randn(6, D)
    tiny.reset(16)
    plain = tiny.forward(ids)
    tiny.reset(16)
    both = tiny.forward(ids, side=side)
    assert both.shape == (len(ids), V + 6)
    assert torch.equal(both[:, :V], plain)
    torch.testing.assert_close(both[:, V:], last_hidden(tiny.module, ids).float() @ side.T, rtol=1e-5, atol=1e-5)
    tiny.reset_batch(16, 2)
    rows = tiny.forward_batch([torch.tensor(ids), torch.tensor(ids[:3])], side=side)
    torch.testing.assert_close(rows[0], both)
    torch.testing.assert_close(rows[1], both[:3])


def test_side_rows_are_refused_where_they_cannot_be_scored(tiny):
    with pytest.raises(ValueError, match=r"side rows must be \[E, 32\]"):
        tiny.forward([1, 2], side=torch.randn(4, D + 1))
    draft = tiny.fork()
    draft.restrict_head(list(range(10)))
    with pytest.raises(ValueError, match="full output head"):
        draft.forward([1, 2], side=torch.randn(4, D))


@needs_model
def test_the_kernel_scores_side_rows_beside_the_logits_unchanged():
    # The kernel scores whatever rows it is given: appended rows leave the logits as they were
    # (bit for bit), and the identity's rows give the hidden state itself, whose products
    # with the head's rows are the side outputs.
    target = specdec.load_model("smollm2-135m-instruct")
    d = target.module.cfg.hidden_size
    ids = target.tokenizer.encode("The capital of France is Paris. The capital of Italy is")
    side = torch.randn(8, d).to(target.dtype)
    eye = torch.eye(d).to(target.dtype)
    outs = {}
    for name, rows in (("plain", None), ("side", side), ("eye", eye)):
        target.reset(64)
        target.forward(ids[:-4], last_only=True)
        outs[name] = target.forward(ids[-4:], side=rows)  # a verify-sized block
    V_ = target.vocab_size
    assert torch.equal(outs["side"][:, :V_], outs["plain"]) and torch.equal(outs["eye"][:, :V_], outs["plain"])
    h = outs["eye"][:, V_:]
    torch.testing.assert_close(outs["side"][:, V_:], h @ side.float().T, rtol=1e-3, atol=1e-3)


# ----------------------------------------------------------------------------- the drafter


def test_where_nothing_matches_the_head_proposes_its_own_best_token(tiny):
    weight, bias = random_weights(1)
    head = HiddenHead(tiny, weight, bias, torch.arange(V, dtype=torch.int32))
    drafter = CompositeDrafter(lookup=NgramDrafter(3, 3), datastore=Datastore([[63, 62, 61]], V), head=head)
    prompt = [4, 8, 15, 16, 23, 42]
    observed(tiny, drafter, prompt)
    b = 7
    assert drafter.sources(prompt + [b]) == ("head",)
    tokens, q = drafter.propose(prompt + [b], 1, SamplingParams(0.0), None, "head")
    assert q is None and tokens == [int(reference_scores(tiny, weight, bias, prompt, b).argmax())]
    # Only tokens it may propose: with one allowed, that one.
    only = CompositeDrafter(lookup=NgramDrafter(3, 3), datastore=Datastore([[63, 62, 61]], V),
                            head=HiddenHead(tiny, weight, bias, torch.tensor([11], dtype=torch.int32)))
    observed(tiny, only, prompt)
    assert only.propose(prompt + [b], 1, SamplingParams(0.0), None, "head")[0] == [11]
    # A context the last pass did not hold: nothing to read, no head source.
    assert drafter.sources(prompt + [b, 3]) == ()


def test_among_the_stores_candidates_the_head_leads_with_the_one_it_scores_best(tiny):
    # The store writes 9 after (1, 2) twice and 17 once: its own choice is 9. The head scores
    # both; seeds are searched for a head that prefers 17, so that the choice visibly changes.
    store = Datastore([[1, 2, 9, 30], [1, 2, 9, 31], [1, 2, 17, 40, 41]], V)
    prompt = [50, 51, 52, 1, 2]
    for seed in range(50):
        weight, bias = random_weights(seed, 2.0)
        scores = reference_scores(tiny, weight, bias, prompt[:-1], prompt[-1])
        if scores[17] > scores[9]:
            break
    else:
        pytest.fail("no head of 50 prefers 17")
    head = HiddenHead(tiny, weight, bias, torch.arange(V, dtype=torch.int32))
    drafter = CompositeDrafter(lookup=NgramDrafter(3, 3), datastore=store, head=head)
    drafter.begin(16)
    observed(tiny, drafter, prompt[:-1])
    source = drafter.sources(prompt)[0]
    assert source == "store2"
    assert CompositeDrafter(lookup=NgramDrafter(3, 3), datastore=store).propose(
        prompt, 3, SamplingParams(0.0), None, source)[0] == [9, 30]
    # 17 leads, and the store's continuation of (2, 17) follows it.
    assert drafter.propose(prompt, 3, SamplingParams(0.0), None, source)[0] == [17, 40, 41]
    assert drafter.counters() == {"head_led": 1}


def test_greedy_with_the_head_is_plain_greedy_one_prompt_and_a_batch(tiny):
    store = Datastore([np.random.default_rng(0).integers(0, V, 400)], V)
    drafter = CompositeDrafter(lookup=NgramDrafter(3, 3), datastore=store, head=random_head(tiny, 2))
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8]]
    singles = []
    for prompt in prompts:
        plain = generate(tiny, None, prompt, 40).token_ids
        spec = speculative_generate(tiny, drafter, None, prompt, 40)
        assert spec.token_ids == plain
        assert spec.stats.drafted > 0 and spec.stats.drafter["head_led"] > 0
        singles.append(plain)
    batch = speculative_generate(tiny, drafter, None, prompts, 40, num_draft_tokens=3)
    assert [g.token_ids for g in batch] == singles


def test_bad_heads_and_bad_company_are_refused(tiny, tmp_path):
    weight, bias = random_weights()
    digest, every = target_digest(tiny.module), torch.arange(V, dtype=torch.int32)
    with pytest.raises(ValueError, match="no such file"):
        load_head(tmp_path / "missing.safetensors", tiny)
    (tmp_path / "junk.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="not a specdec head"):
        load_head(tmp_path / "junk.safetensors", tiny)
    from safetensors.torch import save_file
    save_file({"weight": weight, "bias": bias, "proposable": every}, str(tmp_path / "bare.safetensors"))
    with pytest.raises(ValueError, match="no format metadata"):
        load_head(tmp_path / "bare.safetensors", tiny)
    save_head(tmp_path / "other.safetensors", weight, bias, every, "0123456789abcdef")
    with pytest.raises(ValueError, match="trained for another target"):
        load_head(tmp_path / "other.safetensors", tiny)
    save_head(tmp_path / "narrow.safetensors", weight[:, :D], bias, every, digest)
    with pytest.raises(ValueError, match=r"the target needs \(32, 64\)"):
        load_head(tmp_path / "narrow.safetensors", tiny)
    save_head(tmp_path / "wide.safetensors", weight, bias, torch.tensor([V], dtype=torch.int32), digest)
    with pytest.raises(ValueError, match="proposable tokens"):
        load_head(tmp_path / "wide.safetensors", tiny)
    save_head(tmp_path / "good.safetensors", weight, bias, every, digest)
    head = load_head(tmp_path / "good.safetensors", tiny)
    store = Datastore([[1, 2, 3]], V)
    with pytest.raises(ValueError, match="needs a datastore"):
        CompositeDrafter(tiny, head=head)
    with pytest.raises(ValueError, match="neither a model draft nor trees"):
        CompositeDrafter(datastore=store, tree_size=4, head=head)
    with pytest.raises(ValueError, match="vocabulary"):
        CompositeDrafter(datastore=Datastore([[1, 2, 3]], V + 1), head=head)
    with pytest.raises(ValueError, match="needs a native target"):
        HiddenHead(tiny_hf_model(), weight, bias, every)
    # A target on an engine without side outputs: refused before any pass.
    with pytest.raises(ValueError, match="side outputs"):
        speculative_generate(tiny_hf_model(), CompositeDrafter(datastore=store, head=head), None, [1, 2, 3], 8)


# ----------------------------------------------------------------------------- training


def test_training_learns_the_token_two_ahead_and_writes_a_head_that_loads(tiny, tmp_path):
    # Sequences of a fixed rule (x -> 5x + 1 mod V): the token after b is a function of b
    # alone, which the head can learn through e(b) and the target cannot know from h.
    rng = np.random.default_rng(0)
    seqs = []
    for start in rng.integers(0, V, 300):
        seq = [int(start)]
        for _ in range(11):
            seq.append((5 * seq[-1] + 1) % V)
        seqs.append(seq)
    data = collect(tiny, Datastore(seqs, V))
    assert len(data["tokens"]) == 300 * 12 and data["h"].shape == (300 * 12, D)
    torch.testing.assert_close(data["h"][:12].float(), last_hidden(tiny.module, seqs[0]).to(torch.bfloat16).float())
    history = train_head(tiny, data, tmp_path / "head.safetensors", epochs=3, batch=64, lr=1e-2, log=lambda _: None)
    # Measured: 0.007 at zero (chance is 1/64), 0.32 after three epochs.
    assert history["epochs"][-1]["held_out_top1"] > history["top1_at_zero"] + 0.2
    head = load_head(tmp_path / "head.safetensors", tiny)
    assert head.side.shape == (D, D) and len(head.proposable) == V  # all V: fewer than it keeps


def test_train_head_command_writes_a_head_its_log_and_a_shipped_copy(tmp_path, capsys):
    from specdec.cli import main

    save_tiny(tmp_path / "target", "llama", 0)
    rng = np.random.default_rng(1)
    Datastore([rng.integers(0, V, 40) for _ in range(60)], V).save(tmp_path / "store.safetensors")
    args = ["train-head", "--target", tmp_path / "target", "--datastore", tmp_path / "store.safetensors",
            "--out", tmp_path / "run", "--epochs", "1", "--batch", "64", "--ship", tmp_path / "ship"]
    assert main([str(a) for a in args]) == 0
    log = json.loads((tmp_path / "ship" / "train-log.json").read_text())
    assert log["positions"] == 60 * 40 and len(log["epochs"]) == 1 and log["command"].startswith("specdec train-head")
    target = specdec.load_model(tmp_path / "target", dtype="bfloat16")
    assert load_head(tmp_path / "ship" / "head.safetensors", target).side.shape == (D, D)
    # Again: the hidden states are read back, not collected twice.
    assert main([str(a) for a in args]) == 0
    assert "hidden states from" in capsys.readouterr().err
    assert main(["train-head", "--datastore", str(tmp_path / "missing.safetensors"), "--target",
                 str(tmp_path / "target"), "--out", str(tmp_path / "run2")]) == 2


# ----------------------------------------------------------------------------- the shipped head


@needs_model
def test_the_shipped_head_loads_for_the_default_target_and_keeps_greedy_output():
    from specdec.bench.suite import load_suite, render

    target = specdec.load_model("smollm2-135m-instruct")
    head = load_head("smollm2-135m-instruct", target)
    assert head.side.shape == (576, 576) and len(head.proposable) == 8192
    drafter = CompositeDrafter(datastore=specdec.load_datastore("smollm2-135m-instruct"), head=head)
    prompts = load_suite("specdec/bench/prompts/heldout-specbench-v1.jsonl")[:26:6]
    render(prompts, target, target.tokenizer)
    led = 0
    for p in prompts:
        spec = speculative_generate(target, drafter, None, p.ids, 48)
        assert spec.token_ids == generate(target, None, p.ids, 48).token_ids
        led += spec.stats.drafter["head_led"]
    assert led > 0
