"""`specdec distill` on a tiny target: agreement rises, training resumes exactly, the
result is a checkpoint both we and transformers load, and the shipped form round-trips."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from specdec.train import distill as D
from specdec import generate, load_model, speculative_generate
from specdec.cli import main
from specdec.train.prompts import passage_requests, training_conversations
from specdec.models.loading import materialize_draft
from tiny import save_tiny

V = 64


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    # Untied, so the draft also shares (and leaves out of its shipped form) the output head.
    path = save_tiny(tmp_path_factory.mktemp("target") / "t", "llama", seed=1)
    return path, AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def examples(target):
    """The tiny target's greedy and sampled continuations of 400 random prompts, with its top-8 labels."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, V, (8,), generator=g).tolist() for _ in range(400)]
    torch.manual_seed(0)
    out = []
    for temp in (0.0, 1.0):
        rows = D.target_writes(target[1], prompts, 24, temp, 8, eos_ids=())
        for i, (comp, ids, logp) in enumerate(rows):
            assert len(comp) == 24 and ids.shape == (24, 8)
            out.append(D.Example(i, temp == 0, torch.tensor(prompts[i] + comp), 8, ids.long(), logp.float()))
    return out


def config(tmp_path, **kw):
    base = dict(target="unused", out=str(tmp_path), layers=1, prompts=400, heldout=40, steps=200, batch_tokens=512,
                lr=3e-3, eval_every=100, save_every=100)
    return D.DistillConfig(**{**base, **kw})


def log_of(path):
    return [json.loads(line) for line in (path / D.LOG_FILE).read_text().splitlines()]


def test_labels_are_the_targets_next_token_distribution(target, examples):
    # The stored top-1 of a greedy continuation is the token the target then chose, and the
    # log-probs are the target's own at that position.
    e = next(e for e in examples if e.greedy)
    assert e.top_ids[:, 0].tolist() == e.tokens[e.prompt_len:].tolist()
    with torch.no_grad():
        logp = target[1](e.tokens[None]).logits[0].log_softmax(-1)
    pos = torch.arange(len(e.top_ids)) + e.prompt_len - 1
    assert torch.allclose(logp[pos].gather(-1, e.top_ids), e.top_logp, atol=2e-2)


def test_the_native_engine_writes_what_transformers_writes(target):
    # distill's data comes from the native engine's batched passes; on the same weights its
    # greedy continuations and labels are transformers' (ragged prompts, rows ending at an EOS).
    native = load_model(target[0], dtype="float32")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (3, 8, 5, 12, 1, 8)]
    ref = D.target_writes(target[1], prompts, 20, 0.0, 8, eos_ids=())
    eos = {ref[2][0][6]}  # a token row 2 writes at step 7: rows stop at its first occurrence
    ref = D.target_writes(target[1], prompts, 20, 0.0, 8, eos_ids=eos)
    got = D.target_writes(native, prompts, 20, 0.0, 8, eos_ids=eos)
    assert any(len(c) < 20 for c, _, _ in got) and any(len(c) == 20 for c, _, _ in got)
    for (c, ids, logp), (rc, rids, rlogp) in zip(got, ref):
        assert c == rc and torch.equal(ids, rids)
        torch.testing.assert_close(logp.float(), rlogp.float(), atol=2e-3, rtol=0)
        assert ids[:, 0].tolist() == c  # greedy: the top label is the token written
    # Sampled: reproducible from the generator, and not the greedy text.
    runs = [D.target_writes(native, prompts, 20, 1.0, 8, (), generator=torch.Generator().manual_seed(5))
            for _ in range(2)]
    assert [c for c, _, _ in runs[0]] == [c for c, _, _ in runs[1]]
    assert [c for c, _, _ in runs[0]] != [c for c, _, _ in D.target_writes(native, prompts, 20, 0.0, 8, ())]


def test_training_raises_heldout_agreement(tmp_path, target, examples):
    D.train(config(tmp_path), examples, target[1], progress=False)
    log = log_of(tmp_path)
    assert [row["step"] for row in log] == [0, 100, 200]
    first, last = log[0]["heldout_greedy_agreement"], log[-1]["heldout_greedy_agreement"]
    # Measured: 0.22 -> 0.62 (a 1-layer draft of a 2-layer random target, 200 steps, about
    # 1.4 passes over the data; with 10x fewer prompts it overfits and agreement falls).
    assert last > first + 0.25, log
    assert log[-1]["loss"] < log[1]["loss"]


def test_resume_reproduces_an_unbroken_run(tmp_path, target, examples, monkeypatch):
    whole = D.train(config(tmp_path / "a", steps=12, save_every=6, eval_every=6), examples, target[1], progress=False)
    real_lr = D._lr

    def crash_at_8(step, cfg):
        if step == 8:
            raise KeyboardInterrupt
        return real_lr(step, cfg)

    cfg = config(tmp_path / "b", steps=12, save_every=6, eval_every=6)
    monkeypatch.setattr(D, "_lr", crash_at_8)
    with pytest.raises(KeyboardInterrupt):
        D.train(cfg, examples, target[1], progress=False)
    monkeypatch.setattr(D, "_lr", real_lr)
    resumed = D.train(cfg, examples, target[1], progress=False)  # from the step-6 checkpoint
    for (name, a), (_, b) in zip(whole.named_parameters(), resumed.named_parameters()):
        assert torch.allclose(a, b, atol=1e-6), name


def test_saved_draft_loads_natively_and_in_transformers(tmp_path, target, examples):
    draft = D.train(config(tmp_path / "run", steps=4), examples, target[1], progress=False)
    D.save_draft(draft, target[0], tmp_path / "run")
    native = load_model(tmp_path / "run", dtype="float32")
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "run"), dtype=torch.float32)
    ids = examples[0].tokens[:12]
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    native.reset(16)
    assert torch.allclose(native.forward(ids), ref, atol=1e-3)
    # It drafts for its target, and greedy output is still the target's.
    tgt = load_model(target[0], dtype="float32")
    prompt = examples[0].tokens[:8].tolist()
    assert speculative_generate(tgt, native, None, prompt, 20).token_ids == generate(tgt, None, prompt, 20).token_ids

    # The shipped form leaves out the shared embeddings and is rebuilt from the target's.
    shipped = D.export_shipped(tmp_path / "run", tmp_path / "ship", str(target[0]))
    from safetensors import safe_open

    with safe_open(str(shipped / "layers.safetensors"), "pt") as f:
        assert not {"model.embed_tokens.weight", "lm_head.weight"} & set(f.keys())
    rebuilt = load_model(materialize_draft(shipped, target[0], tmp_path / "cache"), dtype="float32")
    rebuilt.reset(16)
    assert torch.equal(rebuilt.forward(ids), (native.reset(16), native.forward(ids))[1])
    # ... but never from other embeddings than those it was trained with.
    other = save_tiny(tmp_path / "other", "llama-tied", seed=5)
    with pytest.raises(ValueError, match="trained with"):
        materialize_draft(shipped, other, tmp_path / "cache2")


def test_head_tokens_are_the_most_written_and_ship_with_the_draft(tmp_path, target, examples):
    from specdec import ModelDrafter
    from specdec.models.registry import HEAD_TOKENS_FILE

    draft = D.train(config(tmp_path / "run", steps=2), examples, target[1], progress=False)
    D.save_draft(draft, target[0], tmp_path / "run")
    ids16 = D.head_token_ids(config(tmp_path / "run", head_tokens=16), examples, V, eos_ids=(63,))
    D.write_head_tokens(ids16, examples, 40, tmp_path / "run")
    listed = json.loads((tmp_path / "run" / HEAD_TOKENS_FILE).read_text())
    ids = listed["token_ids"]
    counts = torch.bincount(torch.cat([e.tokens[e.prompt_len:] for e in examples if e.prompt >= 40]), minlength=V)
    top = set(counts.argsort(descending=True, stable=True)[:16].tolist())
    assert set(ids) == top | {63} and ids == sorted(ids)
    held = torch.cat([e.tokens[e.prompt_len:] for e in examples if e.prompt < 40])
    assert listed["heldout_coverage"] == pytest.approx(float(torch.isin(held, torch.tensor(ids)).float().mean()), abs=1e-4)
    # load_model reads the list; ModelDrafter applies it (only to its own fork); both ways
    # greedy output is still the target's.
    native = load_model(tmp_path / "run", dtype="float32")
    assert native.head_tokens == ids and native.head is None
    drafter = ModelDrafter(native)
    assert drafter.model.head[0].tolist() == ids and native.head is None
    assert ModelDrafter(native, head_tokens=None).model.head is None
    tgt = load_model(target[0], dtype="float32")
    prompt = examples[0].tokens[:8].tolist()
    assert speculative_generate(tgt, drafter, None, prompt, 20).token_ids == generate(tgt, None, prompt, 20).token_ids
    # It travels in the shipped form and through materialization.
    shipped = D.export_shipped(tmp_path / "run", tmp_path / "ship", str(target[0]))
    rebuilt = materialize_draft(shipped, target[0], tmp_path / "cache")
    assert json.loads((rebuilt / HEAD_TOKENS_FILE).read_text()) == listed
    # head_tokens=0: no list (the full head).
    assert D.head_token_ids(config(tmp_path / "run", head_tokens=0), examples, V, eos_ids=(63,)) is None
    D.write_head_tokens(None, examples, 40, tmp_path / "run")
    assert not (tmp_path / "run" / HEAD_TOKENS_FILE).exists()


def test_training_on_a_head_list_scores_only_those_tokens(tmp_path, target, examples):
    # The loss renormalizes the target's top-k over the listed tokens: a token off the list
    # carries no weight, and a position whose top-k is all off the list is skipped.
    logits = torch.tensor([[2.0, 0.0, -1.0]])
    both = D.distill_loss(logits, torch.tensor([[0, 1]]), torch.tensor([[-0.1, -2.5]]))
    one = D.distill_loss(logits, torch.tensor([[0, -1]]), torch.tensor([[-0.1, -2.5]]))
    assert one == pytest.approx(-logits.log_softmax(-1)[0, 0].item())  # p = (1, 0) over the list
    assert both > 0 and one > 0
    skipped = D.distill_loss(torch.cat([logits, logits]), torch.tensor([[0, -1], [-1, -1]]),
                             torch.tensor([[-0.1, -2.5], [-0.1, -2.5]]))
    assert skipped == pytest.approx(one.item())
    # Trained on its 24 most written tokens, the draft still learns to agree with the target
    # (agreement measured over the list, as ModelDrafter then drafts).
    ids = D.head_token_ids(config(tmp_path, head_tokens=24), examples, V, eos_ids=(63,))
    head = D.Head(V, ids)
    assert head.column[ids].tolist() == list(range(len(ids))) and int((head.column >= 0).sum()) == len(ids)
    draft = D.train(config(tmp_path, head_tokens=24), examples, target[1], progress=False, head_ids=ids)
    rows = log_of(tmp_path)
    assert rows[-1]["heldout_greedy_agreement"] > rows[0]["heldout_greedy_agreement"] + 0.2
    held = [e for e in examples if e.prompt < 40 and e.greedy]
    assert D.agreement(draft, held, head) == pytest.approx(rows[-1]["heldout_greedy_agreement"], abs=1e-4)


def test_the_datastore_holds_each_reply_once_and_no_prompt(tmp_path, examples):
    from safetensors.torch import save_file

    from specdec import Datastore

    data = tmp_path / "data"
    data.mkdir()
    tensors = {}
    for e in examples:  # a shard as generate_data writes it
        key = f"{e.prompt}.{'greedy' if e.greedy else 'sampled'}"
        tensors[f"{key}.tokens"] = e.tokens.int()
        tensors[f"{key}.prompt_len"] = torch.tensor([e.prompt_len], dtype=torch.int32)
        tensors[f"{key}.top_ids"], tensors[f"{key}.top_logp"] = e.top_ids.contiguous(), e.top_logp.contiguous()
    save_file(tensors, str(data / "shard-0000.safetensors"))
    path = D.write_datastore([data, data], tmp_path / "store" / "s.safetensors", V, "a recipe")
    store = Datastore.load(path)
    replies = {tuple(e.tokens[e.prompt_len:].tolist()) for e in examples}
    assert len(store) == sum(map(len, replies))  # each distinct reply once, though its data came twice
    reply = list(next(iter(replies)))
    assert store.match(reply[:8])[0] == 8
    with pytest.raises(ValueError, match="no training data"):
        D.write_datastore([tmp_path / "store"], tmp_path / "t.safetensors", V)


def test_an_old_pickled_resume_state_is_refused_not_read(tmp_path, target, examples):
    (tmp_path / "train-state.pt").write_bytes(b"not read")
    with pytest.raises(ValueError, match="old pickle form"):
        D.train(config(tmp_path, steps=2), examples, target[1], progress=False)


def test_narrower_draft_has_its_own_embeddings(tmp_path, target, examples):
    draft = D.train(config(tmp_path, steps=2, hidden=16), examples, target[1], progress=False)
    assert draft.config.hidden_size == 16 and draft.config.num_attention_heads == 2
    _, trained, _, _ = D.load_state(tmp_path / D.STATE_FILE)
    assert "model.embed_tokens.weight" in trained  # trained, so checkpointed
    for bad in (12, 64):  # not a whole number of heads; wider than the target
        with pytest.raises(ValueError, match="head size 8"):
            D.draft_config(target[1].config, config(tmp_path, hidden=bad))


def test_training_prompts_are_disjoint_from_the_bench_and_deterministic():
    from specdec.bench.suite import SUITE_DIR, load_suite

    bench = {t for p in load_suite() for t in p.turns}
    convs = training_conversations(300, seed=0, exclude=bench)
    assert len(convs) == 300 and not bench & {t for c in convs for t in c}
    # The held-out Spec-Bench-style prompts were written apart from the training templates:
    # none is a training prompt even when nothing excludes them.
    heldout = {t for p in load_suite(SUITE_DIR / "heldout-specbench-v1.jsonl") for t in p.turns}
    assert len(heldout) == 26 + 16 and not heldout & {t for c in convs for t in c}
    loops = {t for p in load_suite(SUITE_DIR / "editing-loops-v1.jsonl") for t in p.turns}
    assert len(loops) == 8 * 3 and not loops & {t for c in convs for t in c}
    assert convs == training_conversations(300, seed=0, exclude=bench)
    assert len({c[0] for c in convs}) == 300
    # The target's own passages join the text to summarize and question.
    requests = passage_requests(40, seed=0)
    assert len(set(requests)) == 40 and requests == passage_requests(40, seed=0)
    written = [f"Passage number {i} was written by the target. It has two sentences." for i in range(30)]
    text = "\n".join(turn for c in training_conversations(300, 0, bench, written) for turn in c)
    used = [p for p in written if p in text]
    assert used  # about 1 in 6 passages is used at 300 prompts


def test_the_spec_bench_mix_adds_its_kinds_and_stays_disjoint():
    from specdec.bench.suite import SUITE_DIR, load_suite

    bench = {t for p in load_suite() + load_suite(SUITE_DIR / "heldout-specbench-v1.jsonl") for t in p.turns}
    written = [f"Report {i} from the town hall. It names {i} people and two places." for i in range(120)]
    convs = training_conversations(400, seed=0, exclude=bench, written=written, mix="spec-bench")
    assert convs == training_conversations(400, seed=0, exclude=bench, written=written, mix="spec-bench")
    assert len(convs) == 400 and not bench & {t for c in convs for t in c}
    firsts = [c[0] for c in convs]
    for needle in ("Translate the following German text into English", "Stay in character", "Extract",
                   "Write a ", "Passage:\n"):
        assert sum(needle in t for t in firsts) >= 10, needle
    # Long articles: several of the target's reports joined.
    assert any(t.count("Report ") >= 3 for t in firsts)
    # v1 is unchanged by the new kinds: none of them appear there.
    v1 = [c[0] for c in training_conversations(400, seed=0, exclude=bench, written=written)]
    assert not any("Stay in character" in t or t.startswith("Extract") for t in v1)
    with pytest.raises(ValueError, match="mix must be one of"):
        training_conversations(10, mix="v3")
    with pytest.raises(ValueError, match="mix must be one of"):
        D.DistillConfig(target="x", out="y", mix="v3").check()


@pytest.mark.parametrize("args, message", [
    (["--heldout", "5000"], "heldout must be"),
    (["--steps", "5", "--lr", "-1"], "lr and temperature must be > 0"),
    (["--target", "/nonexistent/model"], "no such model"),
])
def test_cli_rejects_bad_settings(tmp_path, capsys, args, message):
    assert main(["distill", "--out", str(tmp_path / "o"), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_resuming_with_other_settings_is_refused(tmp_path):
    (tmp_path / "recipe.json").write_text(json.dumps({**vars(config(tmp_path)), "lr": 1.0}))
    with pytest.raises(ValueError, match="other settings"):
        D.distill(config(tmp_path))


def test_check_accepts_the_defaults():
    D.DistillConfig(target="x", out="y").check()
    with pytest.raises(ValueError):
        replace(D.DistillConfig(target="x", out="y"), temperature=0).check()


def test_the_target_writes_its_own_user_turns_for_the_self_mix():
    # Mix "self": the real target, from its chat template's user header and an opener, writes
    # requests that are distinct, start with their opener, end where it ended its turn, and
    # leave out anything excluded; the same seed writes the same turns.
    from transformers import AutoTokenizer

    from specdec.train.prompts import OPENERS, openers
    from specdec.models.loading import hf_checkpoint

    path = hf_checkpoint("smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = load_model(path, dtype="bfloat16")
    eos = set(model.eos_token_ids)
    assert D.user_turn_prefix(tokenizer).endswith("<|im_start|>user\n")
    turns = D.target_prompts(model, tokenizer, 12, seed=3, eos_ids=eos, batch=8)
    assert len(turns) == 12 and len(set(turns)) == 12
    assert all(len(t) >= 16 and "<|im_end|>" not in t and "<|im_start|>" not in t for t in turns)
    named = [o for o in OPENERS if o]
    assert sum(any(t.startswith(o) for o in named) for t in turns) >= 6  # most have an opener
    assert D.target_prompts(model, tokenizer, 12, seed=3, eos_ids=eos, batch=8) == turns
    again = D.target_prompts(model, tokenizer, 12, seed=3, eos_ids=eos, batch=8, exclude={turns[0]})
    assert turns[0] not in again and again[0] == turns[1]
    assert openers(50, seed=0) == openers(50, seed=0) and set(openers(500, seed=0)) == set(OPENERS)
    # The spec-bench templates make the other half, so the mix takes "self" too.
    assert training_conversations(20, seed=0, mix="self") == training_conversations(20, seed=0, mix="spec-bench")
