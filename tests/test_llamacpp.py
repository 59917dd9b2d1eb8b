"""The llama.cpp engine, on GGUF files written here from tiny random Llamas and from the
embedded model: the same contracts as the native engine (greedy speculative output is
plain greedy output on the same engine, sampling keeps the distribution, the cache after
any accept/reject is the accepted prefix's), and clear errors."""
from __future__ import annotations

import builtins
import subprocess
import sys

import numpy as np
import pytest
import torch

from specdec import CompositeDrafter, Datastore, NgramDrafter, generate, load_model, speculative_generate
from specdec.models.gguf_write import write_gguf
from tiny import needs_model, save_tiny

llama_cpp = pytest.importorskip("llama_cpp", reason="the llama.cpp engine needs pip install 'specdec[llamacpp]'")

from specdec.models.llamacpp import LlamaCppLM  # noqa: E402

TORCH_THREADS = 1  # read by conftest.py; the contexts take torch's thread count
PROMPTS = {"short": [7], "random": [3, 41, 17, 59, 8, 22, 36, 1, 50],
           "repeated": [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7, 8, 5, 6, 7]}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("llamacpp")
    out = {}
    for name, kind, seed in (("target", "llama", 0), ("draft", "llama", 1), ("qwen2", "qwen2", 0)):
        ckpt = save_tiny(d / name, kind, seed=seed)
        out[name] = (ckpt, write_gguf(ckpt, d / f"{name}.gguf", file_type="f32"))
    return out


@pytest.fixture(scope="module")
def target(files):
    return load_model(files["target"][1], engine="llama.cpp")


def test_gguf_logits_match_the_native_engine(files):
    for name in ("target", "qwen2"):  # llama permutes q/k rows in GGUF, qwen2 does not
        ckpt, gguf = files[name]
        native, ours = load_model(ckpt, dtype="float32"), load_model(gguf, engine="llama.cpp")
        assert isinstance(ours, LlamaCppLM) and ours.path == gguf and ours.vocab_size == 64
        ids = PROMPTS["random"]
        native.reset(16)
        ours.reset(16)
        ref = native.forward(ids)
        got = ours.forward(ids[:4])  # in two passes: positions continue from the cache
        got = torch.cat([got, ours.forward(ids[4:])])
        assert got.shape == ref.shape
        torch.testing.assert_close(got, ref, atol=2e-3, rtol=1e-3)
        assert ours.forward([5], last_only=True).shape == (1, 64)


@pytest.mark.parametrize("k", [1, 4, "auto"])
@pytest.mark.parametrize("kind", ["self", "other", "ngram", "composite", "store"])
@pytest.mark.parametrize("prompt", sorted(PROMPTS))
def test_speculative_equals_greedy_on_the_engine(target, files, kind, k, prompt):
    ref = generate(target, None, PROMPTS[prompt], 24)
    draft = {"self": lambda: target, "other": lambda: load_model(files["draft"][1], engine="llama.cpp"),
             "ngram": NgramDrafter, "composite": lambda: CompositeDrafter(
                 load_model(files["draft"][1], engine="llama.cpp")),
             "store": lambda: CompositeDrafter(load_model(files["draft"][1], engine="llama.cpp"), datastore=Datastore(
                 [generate(target, None, [t, 2 * t], 16).token_ids for t in range(1, 30)], target.vocab_size))}[kind]()
    out = speculative_generate(target, draft, None, PROMPTS[prompt], 24, num_draft_tokens=k)
    assert out.token_ids == ref.token_ids
    if kind == "self" and k != "auto":
        assert out.stats.accepted == out.stats.drafted  # a model drafting for itself is always right


@pytest.mark.parametrize("file_type,atol", [("q8_0", 0.05), ("q4_0", 0.5)])
def test_a_quantized_draft_is_close_and_output_stays_exact(target, files, tmp_path, file_type, atol):
    ckpt, f32 = files["draft"]
    quantized = load_model(write_gguf(ckpt, tmp_path / f"draft.{file_type}.gguf", file_type=file_type),
                           engine="llama.cpp")
    assert quantized.path.stat().st_size < f32.stat().st_size / 2
    reference = load_model(f32, engine="llama.cpp")
    ids = PROMPTS["random"]
    for m in (quantized, reference):
        m.reset(16)
    got, ref = quantized.forward(ids), reference.forward(ids)
    assert 0 < (got - ref).abs().max() < atol  # quantized (not a copy of the f32 weights), and near them
    prompt = PROMPTS["repeated"]
    assert (speculative_generate(target, quantized, None, prompt, 24, num_draft_tokens=3).token_ids
            == generate(target, None, prompt, 24).token_ids)
    with pytest.raises(ValueError, match="file_type must be one of"):
        write_gguf(ckpt, tmp_path / "x.gguf", file_type="q3_x")


def test_fork_shares_the_weights_not_the_cache(target):
    twin = target.fork()
    assert twin._weights is target._weights
    target.reset(8)
    twin.reset(8)
    target.forward([1, 2, 3])
    twin.forward([9])
    mine, theirs = target.forward([4])[-1], twin.forward([4])[-1]
    fresh = target.fork()
    fresh.reset(8)
    torch.testing.assert_close(mine, fresh.forward([1, 2, 3, 4])[-1], atol=1e-4, rtol=1e-4)
    fresh.reset(8)
    torch.testing.assert_close(theirs, fresh.forward([9, 4])[-1], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(mine, theirs)


def test_cache_after_random_accept_and_reject_is_the_prefix(target):
    # Random blocks, random rollbacks: the logits of the next pass equal those of a fresh
    # context that read exactly the kept tokens.
    g = np.random.default_rng(0)
    seq = [3, 9, 27]
    target.reset(128)
    target.forward(seq)
    fresh = target.fork()
    for _ in range(20):
        block = g.integers(0, 64, size=int(g.integers(1, 6))).tolist()
        target.forward(block)
        keep = int(g.integers(0, len(block) + 1))
        target.rollback(len(seq) + keep)
        seq += block[:keep]
        assert target.cache_len == len(seq)
        probe = int(g.integers(0, 64))
        got = target.forward([probe])[-1]
        target.rollback(len(seq))
        fresh.reset(128)
        want = fresh.forward(seq + [probe], last_only=True)[-1]
        torch.testing.assert_close(got, want, atol=2e-3, rtol=1e-3)  # f32 rounding differs by block shape


def test_bad_input(tmp_path, files, monkeypatch):
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        load_model(tmp_path / "missing.gguf", engine="llama.cpp")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(ValueError, match="junk.gguf: GGUF version 0"):  # checked before llama.cpp sees it
        load_model(junk, engine="llama.cpp")
    with pytest.raises(ValueError, match="engine must be one of"):
        load_model(files["target"][1], engine="vllm")
    target = load_model(files["target"][1], engine="llama.cpp")
    with pytest.raises(ValueError, match="context"):
        generate(target, None, [1] * 10, target.max_context)
    # llama.cpp has sequence ids, but this engine runs one sequence: a batch is refused up front.
    with pytest.raises(ValueError, match="runs one prompt at a time"):
        generate(target, None, [[1, 2], [3]], 4)
    with pytest.raises(ValueError, match="runs one prompt at a time"):
        speculative_generate(target, NgramDrafter(), None, [[1, 2], [3]], 4)
    real_import = builtins.__import__

    def no_llama_cpp(name, *args, **kwargs):
        if name == "llama_cpp":
            raise ModuleNotFoundError("No module named 'llama_cpp'", name="llama_cpp")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_llama_cpp)
    with pytest.raises(ImportError, match=r"specdec\[llamacpp\]"):
        load_model(files["target"][1], engine="llama.cpp")


# ----------------------------------------------------------------------------- sampling: exact


def test_sampling_keeps_the_target_distribution(tmp_path, monkeypatch):
    from test_distribution import (ALPHA, BROKEN_MAX_P, DRAFT_SEED, PROMPT, TARGET_SEED, V, SamplingParams,
                                   chisquare_pvalue, draw, exact_distribution, tiny_hf_model)

    paths = {}
    for name, seed in (("target", TARGET_SEED), ("draft", DRAFT_SEED)):
        paths[name] = write_gguf(save_tiny(tmp_path / name, "llama", seed, vocab_size=V), tmp_path / f"{name}.gguf",
                                 file_type="f32")
    target = load_model(paths["target"], engine="llama.cpp")
    draft = load_model(paths["draft"], engine="llama.cpp")
    exact = exact_distribution(tiny_hf_model("llama", TARGET_SEED, vocab_size=V), PROMPT, 4,
                               SamplingParams(temperature=1.0))

    def run(seed):
        return speculative_generate(target, draft, None, PROMPT, 4, num_draft_tokens=2, temperature=1.0, seed=seed)

    tally = draw(run)
    assert tally.drafted > tally.accepted > 0
    assert chisquare_pvalue(tally.counts, exact) > ALPHA
    import specdec.decoding as decoding
    from test_distribution import reused_noise

    monkeypatch.setattr(decoding, "verify", reused_noise)  # the broken variant
    assert chisquare_pvalue(draw(run).counts, exact) < BROKEN_MAX_P


# ----------------------------------------------------------------------------- the embedded model


@needs_model
def test_embedded_model_and_shipped_draft_on_the_engine():
    target = load_model("smollm2-135m-instruct", engine="llama.cpp")
    draft = load_model("smollm2-135m-instruct-draft", engine="llama.cpp")
    assert target.path.name.endswith(".bf16.gguf") and draft.path.name.endswith(".bf16.gguf")
    assert target.tokenizer is not None and target.vocab_size == 49152 and 2 in target.eos_token_ids
    # The same bf16 weights the native engine runs: the same greedy choice on a prompt.
    native = load_model("smollm2-135m-instruct", dtype="bfloat16")
    ids = target.tokenizer("The capital of France is")["input_ids"]
    for m in (target, native):
        m.reset(len(ids))
    a, b = target.forward(ids, last_only=True)[-1], native.forward(ids, last_only=True)[-1]
    assert int(a.argmax()) == int(b.argmax())
    ref = generate(target, target.tokenizer, "Name three colours.", 24, chat=True)
    out = speculative_generate(target, CompositeDrafter(draft), target.tokenizer, "Name three colours.", 24,
                               chat=True)
    assert out.stats.accepted > 0
    if out.token_ids != ref.token_ids:  # a block and a one-token pass may round a near-tie differently
        from specdec.bench.runner import divergence

        d = divergence(target, ref.prompt_ids, ref.token_ids, out.token_ids)
        assert d.get("tie", True), d


QUANTIZED_RUN = (
    "from specdec.models.loading import embedded_gguf_path; from specdec.models import llamacpp; "
    "from specdec.bench.methods import LlamaCpp; p = embedded_gguf_path('smollm2-135m-instruct'); "
    "m = llamacpp.LlamaCppLM(p); m.reset(64); print(int(m.forward(list(range(5, 25)), last_only=True)[-1].argmax())); "
    "peer = LlamaCpp('peer', p, eos_ids=[2], n_ctx=64, threads=2); print(len(peer.call(list(range(5, 25)), 4)[0]))")


@needs_model
def test_the_embedded_quantized_file_runs_on_this_cpu():
    # llama.cpp's AMX backend segfaults on quantized weights on an AMX CPU (ggml-org/llama.cpp#20824):
    # there the engine and the bench's llama.cpp peer keep the weights in plain CPU buffers. Run
    # apart, so that a segfault fails this test instead of ending the whole run. (With
    # `llamacpp.has_amx_backend = lambda lib: False` first, it ends in SIGSEGV on an AMX CPU.)
    done = subprocess.run([sys.executable, "-c", QUANTIZED_RUN], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[1] == "4"


@needs_model
def test_bench_on_the_engine_with_llama_cpp_peers(tmp_path):
    import json

    from specdec.bench.report import write_report
    from specdec.bench.runner import BenchConfig, run_benchmark

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "category": "rag", "turns": [
        "Passage: The ferry leaves the north pier at nine and at noon.\n\nQuestion: When does the ferry leave?"]}) + "\n")
    cfg = BenchConfig(engine="llama.cpp", draft="smollm2-135m-instruct-draft", datastore="smollm2-135m-instruct",
                      prompts=str(prompts), max_tokens=10, trials=1, threads=2, peers=False)
    report = run_benchmark(cfg, progress=False, log=lambda msg: None)
    names = [m["name"] for m in report["methods"]]
    assert names == ["normal", "spec-ngram-kauto", "spec-store-kauto", "spec-draft-kauto", "spec-composite-kauto",
                     "llama.cpp-greedy", "llama.cpp-prompt-lookup-k10"]
    assert report["environment"]["engine"] == "llama.cpp" and report["environment"]["llama_cpp_python"]
    by = {m["name"]: m for m in report["methods"]}
    for name in names:  # the same weights and greedy: any divergence must be a tie
        assert all(x.get("tie") for x in by[name]["mismatches"]), (name, by[name]["mismatches"])
    assert by["llama.cpp-greedy"]["family"] == "llama.cpp" and by["llama.cpp-greedy"]["overall"]["tokens"] > 0
    assert by["llama.cpp-greedy"]["overall"]["vs_llama_cpp"]["geomean"] == 1.0  # against itself
    for name in names:
        assert by[name]["overall"]["vs_llama_cpp"]["geomean"] > 0 and "vs_llama_cpp" in by[name]["categories"]["rag"]
    write_report(report, tmp_path / "out")
    assert "Speedup over llama.cpp's own plain decoding" in (tmp_path / "out" / "report.md").read_text()


def test_distill_writes_the_draft_as_gguf(tmp_path):
    from specdec.train.distill import DRAFT_GGUF, write_draft_gguf

    ckpt = save_tiny(tmp_path / "draft", "llama", seed=3)
    path = write_draft_gguf(ckpt, str(ckpt))  # a target without a GGUF of its own: token ids only
    assert path == ckpt / DRAFT_GGUF
    native, ours = load_model(ckpt, dtype="float32"), load_model(path, engine="llama.cpp")
    native.reset(8)
    ours.reset(8)
    # bf16 weights on llama.cpp against float32 ones: close, not equal
    torch.testing.assert_close(ours.forward([1, 2, 3]), native.forward([1, 2, 3]), atol=0.3, rtol=0.05)


@needs_model
def test_cli_generate_on_the_engine(capsys):
    from specdec.cli import main

    assert main(["generate", "What is 2+2?", "--engine", "llama.cpp", "--max-tokens", "8"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() and "tokens/target call" in err.strip().splitlines()[-1]


def test_a_checkpoint_with_a_bpe_tokenizer_is_written_with_it(tmp_path):
    # Without a reference GGUF, the tokenizer's vocabulary and merges go into the file, so
    # llama.cpp has a real vocabulary (here: byte-level BPE trained on a few sentences).
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the cat sat on the mat", "the dog sat on the log"] * 20, trainer)
    end = tok.token_to_id("<|end|>")
    ckpt = save_tiny(tmp_path / "bpe", "llama", seed=0, vocab_size=tok.get_vocab_size(), eos_token_id=end)
    tok.save(str(ckpt / "tokenizer.json"))
    model = load_model(write_gguf(ckpt, tmp_path / "bpe.gguf", file_type="f32"), engine="llama.cpp")
    assert model.vocab_size == tok.get_vocab_size() > 256
    lib, vocab = llama_cpp, llama_cpp.llama_model_get_vocab(model._weights.ptr)
    assert lib.llama_vocab_type(vocab) == lib.LLAMA_VOCAB_TYPE_BPE
    assert lib.llama_vocab_get_text(vocab, end) == b"<|end|>" and model.eos_token_ids == (end,)


@needs_model
def test_cli_demo_on_the_engine(capsys):
    from specdec.cli import main

    assert main(["demo", "--engine", "llama.cpp", "--max-tokens", "12", "--trials", "1"]) == 0
    out = capsys.readouterr().out
    assert "=== speculative decoding" in out and "speedup" in out and "acceptance rate" in out
