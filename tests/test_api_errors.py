"""Bad inputs are refused up front: the right exception, a message naming the problem, and no compute."""
from __future__ import annotations

import pytest
import torch

from specdec import HFAdapter, NativeLM, NgramDrafter, generate, load_model, speculative_generate
from specdec.models.llama import Llama
from specdec.schedule import AdaptiveK
from tiny import save_tiny, tiny_hf_model

PROMPT = [1, 2, 3, 4]
VOCAB = 64
CONTEXT = 256  # max_position_embeddings of the tiny models


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("api")
    return {
        "target": load_model(save_tiny(d / "target", "llama", seed=0), dtype="float32"),
        "draft": load_model(save_tiny(d / "draft", "llama", seed=1), dtype="float32"),
        "wide_draft": load_model(save_tiny(d / "wide", "llama", seed=1, vocab_size=80), dtype="float32"),
        "hf_target": tiny_hf_model("llama", seed=0),
        "hf_wide_draft": tiny_hf_model("qwen2", seed=0, vocab_size=96),
    }


@pytest.fixture
def no_compute(monkeypatch):
    """Any forward pass or cache allocation fails the test: errors must come before compute."""
    def boom(*args, **kwargs):
        raise AssertionError("the model ran before the input was checked")

    for cls in (NativeLM, HFAdapter):
        monkeypatch.setattr(cls, "forward", boom)
        monkeypatch.setattr(cls, "reset", boom)
    monkeypatch.setattr(Llama, "forward", boom)


# (name, kwargs overriding the good call, exception type, message pattern)
COMMON = [
    ("empty string prompt", dict(prompt=""), ValueError, "prompt is empty"),
    ("empty list prompt", dict(prompt=[]), ValueError, "prompt is empty"),
    ("empty tensor prompt", dict(prompt=torch.tensor([], dtype=torch.long)), ValueError, "prompt is empty"),
    ("negative max_tokens", dict(max_tokens=-1), ValueError, "max_tokens"),
    ("float max_tokens", dict(max_tokens=2.5), TypeError, "max_tokens"),
    ("string max_tokens", dict(max_tokens="8"), TypeError, "max_tokens"),
    ("bool max_tokens", dict(max_tokens=True), TypeError, "max_tokens"),
    ("negative temperature", dict(temperature=-0.5), ValueError, "temperature"),
    ("nan temperature", dict(temperature=float("nan")), TypeError, "temperature"),
    ("string temperature", dict(temperature="1"), TypeError, "temperature"),
    ("top_p 0", dict(temperature=1.0, top_p=0), ValueError, "top_p"),
    ("top_p 1.5", dict(temperature=1.0, top_p=1.5), ValueError, "top_p"),
    ("top_p negative", dict(temperature=1.0, top_p=-0.1), ValueError, "top_p"),
    ("top_k 0", dict(temperature=1.0, top_k=0), ValueError, "top_k"),
    ("top_k negative", dict(temperature=1.0, top_k=-3), ValueError, "top_k"),
    ("top_k float", dict(temperature=1.0, top_k=2.5), ValueError, "top_k"),
    ("negative token id", dict(prompt=[1, -1, 2]), ValueError, r"token id -1 .*vocabulary"),
    ("token id == vocab", dict(prompt=[1, VOCAB, 2]), ValueError, rf"token id {VOCAB} .*vocabulary"),
    ("token id >> vocab", dict(prompt=[10**6]), ValueError, "vocabulary"),
    ("non-int token id", dict(prompt=[1, 2.0]), TypeError, "integers"),
    ("bool token id", dict(prompt=[True]), TypeError, "integers"),
    ("prompt of another type", dict(prompt=3), TypeError, "prompt"),
    ("beyond max_context", dict(prompt=[1] * 10, max_tokens=CONTEXT - 9), ValueError, "context"),
    ("prompt alone beyond max_context", dict(prompt=[1] * (CONTEXT + 1), max_tokens=0), ValueError, "context"),
    ("string prompt without tokenizer", dict(prompt="hello"), ValueError, "tokenizer"),
    ("chat=True with ids", dict(chat=True), ValueError, "chat"),
]

SPECULATIVE_ONLY = [
    ("num_draft_tokens 0", dict(num_draft_tokens=0), ValueError, "num_draft_tokens"),
    ("num_draft_tokens -1", dict(num_draft_tokens=-1), ValueError, "num_draft_tokens"),
    ("num_draft_tokens 1.5", dict(num_draft_tokens=1.5), ValueError, "num_draft_tokens"),
    ("num_draft_tokens '4'", dict(num_draft_tokens="4"), ValueError, "num_draft_tokens"),
    ("num_draft_tokens True", dict(num_draft_tokens=True), ValueError, "num_draft_tokens"),
    ("num_draft_tokens the AdaptiveK class", dict(num_draft_tokens=AdaptiveK), ValueError, "num_draft_tokens"),
]


def call_generate(models, target="target", **kw):
    args = dict(prompt=PROMPT, max_tokens=8)
    args.update(kw)
    prompt, max_tokens = args.pop("prompt"), args.pop("max_tokens")
    return generate(models[target], None, prompt, max_tokens, **args)


def call_speculative(models, target="target", draft="draft", **kw):
    args = dict(prompt=PROMPT, max_tokens=8)
    args.update(kw)
    prompt, max_tokens = args.pop("prompt"), args.pop("max_tokens")
    d = NgramDrafter() if draft == "ngram" else models[draft]
    return speculative_generate(models[target], d, None, prompt, max_tokens, **args)


def ids(cases):
    return [c[0] for c in cases]


@pytest.mark.parametrize("target", ["target", "hf_target"])
@pytest.mark.parametrize("name, kw, exc, pattern", COMMON, ids=ids(COMMON))
def test_generate_refuses(name, kw, exc, pattern, target, models, no_compute):
    with pytest.raises(exc, match=pattern):
        call_generate(models, target=target, **kw)


@pytest.mark.parametrize("draft", ["draft", "ngram"])
@pytest.mark.parametrize("name, kw, exc, pattern", COMMON + SPECULATIVE_ONLY, ids=ids(COMMON + SPECULATIVE_ONLY))
def test_speculative_refuses(name, kw, exc, pattern, draft, models, no_compute):
    with pytest.raises(exc, match=pattern):
        call_speculative(models, draft=draft, **kw)


@pytest.mark.parametrize("target, draft", [("target", "wide_draft"), ("target", "hf_wide_draft"),
                                           ("hf_target", "wide_draft")])
def test_draft_with_another_vocabulary_and_no_tokenizers(target, draft, models, no_compute):
    # Another vocabulary is bridged through text (test_bridge.py), which needs both tokenizers.
    with pytest.raises(ValueError, match="vocabulary differs from the target's.*needs both tokenizers"):
        call_speculative(models, target=target, draft=draft)


def test_a_model_free_drafter_with_another_vocabulary_is_refused(models, no_compute):
    # Only a model draft can be bridged through text; a datastore of another vocabulary, alone
    # or inside a composite (beside a draft that needs no bridge), is refused by the one decision.
    from specdec import CompositeDrafter, Datastore, DatastoreDrafter

    wide = Datastore([[1, 2, 3, 1, 2]], VOCAB + 16)
    for drafter in (DatastoreDrafter(wide), CompositeDrafter(datastore=wide)):
        with pytest.raises(ValueError, match=r"another vocabulary \(80\) than the target's \(64\)"):
            speculative_generate(models["target"], drafter, None, PROMPT, 8)


def test_the_default_drafter_of_a_target_without_shipped_parts_is_prompt_lookup(models):
    from specdec import default_drafter

    assert isinstance(default_drafter(models["target"]), NgramDrafter)


def test_wrong_model_and_draft_types(models, no_compute):
    with pytest.raises(TypeError, match="model"):
        generate("not a model", None, PROMPT, 4)
    with pytest.raises(TypeError, match="model"):
        speculative_generate(models["target"], object(), None, PROMPT, 4)


def test_chat_string_prompt_without_tokenizer(models, no_compute):
    with pytest.raises(ValueError, match="tokenizer"):
        call_generate(models, prompt="hi", chat=True)


def test_good_call_still_works(models):
    """The same calls with good arguments do run (guards against a fixture that breaks everything)."""
    assert len(call_generate(models).token_ids) == 8
    assert len(call_speculative(models).token_ids) == 8
    assert len(call_speculative(models, draft="ngram", temperature=1.0, top_p=0.9, top_k=5, seed=0).token_ids) == 8
    # edge values that are allowed
    assert len(call_generate(models, prompt=[0, VOCAB - 1], max_tokens=CONTEXT - 2).token_ids) == CONTEXT - 2
    assert len(call_generate(models, temperature=1.0, top_p=1.0, top_k=1, seed=0).token_ids) == 8
    assert call_generate(models, prompt=torch.tensor(PROMPT)).token_ids == call_generate(models).token_ids


class CountingTokenizer:
    """Just what the vocabulary check reads, counting how often it builds the vocabulary."""

    def __init__(self, vocab):
        self.vocab, self.built = vocab, 0

    def get_vocab(self):
        self.built += 1
        return dict(self.vocab)


def test_another_tokenizer_is_told_apart_once(models, no_compute):
    from specdec import ModelDrafter
    from specdec.bridge import TextBridge, for_target

    mine = CountingTokenizer({"a": 0, "b": 1})
    theirs = CountingTokenizer({"a": 0, "c": 1})
    drafter = ModelDrafter(models["draft"], tokenizer=theirs)
    for _ in range(2):
        assert isinstance(for_target(drafter, models["target"], mine), TextBridge)
    assert for_target(drafter, models["target"], theirs) is drafter  # the same tokenizer: no bridge
    assert mine.built == theirs.built == 1  # fingerprinted once per tokenizer, not per call
