"""The methods a benchmark compares, behind one call: run(prompt_ids, max_tokens) -> Result.

Ours: plain decoding (the baseline) and speculative decoding with a drafter and k.
Peers, on the same weights in the same process: transformers' greedy `generate`, its
assisted generation (default schedule, and a constant one) and its prompt lookup; and
llama.cpp's own generation loop, plain and with its own prompt-lookup speculation.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..decoding import generate, speculative_generate


@dataclass
class Result:
    token_ids: list[int]
    seconds: float
    prefill_seconds: float | None  # None where the method does not expose it
    stats: dict | None  # specdec Stats as a dict, for our methods


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _stats_dict(s) -> dict:
    return {"target_calls": s.target_calls, "draft_calls": s.draft_calls, "drafted": s.drafted,
            "accepted": s.accepted, "rejections": s.rejections, "plain_steps": s.plain_steps,
            "generated": s.generated, "proposed_at": list(s.proposed_at), "accepted_at": list(s.accepted_at),
            "timings": dict(s.timings), "drafter": dict(s.drafter)}


class Method:
    name: str
    family: str  # "baseline" | "specdec" | "transformers"
    drafter: str | None = None
    k: int | str | None = None
    device = "cpu"

    def call(self, prompt_ids, max_tokens):
        raise NotImplementedError

    def run(self, prompt_ids: list[int], max_tokens: int) -> Result:
        _sync(self.device)
        t0 = time.perf_counter()
        tokens, prefill, stats = self.call(prompt_ids, max_tokens)
        _sync(self.device)
        return Result(tokens, time.perf_counter() - t0, prefill, stats)

    def describe(self) -> dict:
        return {"name": self.name, "family": self.family, "drafter": self.drafter, "k": self.k}


class Normal(Method):
    name, family = "normal", "baseline"

    def __init__(self, target, sampling: dict):
        self.target, self.device, self.sampling = target, target.device, sampling

    def call(self, prompt_ids, max_tokens):
        g = generate(self.target, None, prompt_ids, max_tokens, **self.sampling)
        return g.token_ids, g.stats.timings["prefill"], _stats_dict(g.stats)


class Speculative(Method):
    family = "specdec"

    def __init__(self, target, drafter, drafter_name: str, k, sampling: dict):
        self.target, self._drafter, self.device, self.sampling = target, drafter, target.device, sampling
        self.drafter, self.k = drafter_name, k
        self.name = f"spec-{drafter_name}-k{k}"

    def call(self, prompt_ids, max_tokens):
        g = speculative_generate(self.target, self._drafter, None, prompt_ids, max_tokens, num_draft_tokens=self.k,
                                 **self.sampling)
        return g.token_ids, g.stats.timings["prefill"], _stats_dict(g.stats)


class Transformers(Method):
    """transformers' generate() on the same weights; `assistant`/`options` pick the variant."""

    family = "transformers"

    def __init__(self, name, hf_model, *, eos_ids, sampling: dict, assistant=None, assistant_options=None,
                 drafter=None, k=None, **options):
        self.name, self.hf, self.assistant = name, hf_model, assistant
        self.sampling = sampling
        self.assistant_options = assistant_options or {}
        self.options, self.eos_ids = options, list(eos_ids)
        self.drafter, self.k = drafter, k
        self.device = next(hf_model.parameters()).device

    @torch.inference_mode()
    def call(self, prompt_ids, max_tokens):
        ids = torch.tensor([prompt_ids], device=self.device)
        kwargs = dict(self.options)
        if self.assistant is not None:
            # The assistant's generation config persists across calls (its heuristic
            # schedule adapts in place); start every call from the same settings.
            for key, value in self.assistant_options.items():
                setattr(self.assistant.generation_config, key, value)
            kwargs["assistant_model"] = self.assistant
        temperature = self.sampling.get("temperature", 0.0)
        if temperature > 0:
            torch.manual_seed(self.sampling["seed"])
            kwargs.update(do_sample=True, temperature=temperature, top_k=self.sampling.get("top_k") or 0,
                          top_p=self.sampling.get("top_p") or 1.0)
        else:
            kwargs.update(do_sample=False, temperature=None, top_k=None, top_p=None)
        out = self.hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                               eos_token_id=self.eos_ids, pad_token_id=self.eos_ids[0], **kwargs)
        return out[0, len(prompt_ids):].tolist(), None, None


HF_ASSISTED_DEFAULTS = {"num_assistant_tokens": 20, "num_assistant_tokens_schedule": "constant",
                        "assistant_confidence_threshold": 0.4}


def hf_assisted_default(hf, assistant, eos_ids, sampling, drafter_name):
    """transformers' own defaults for assisted generation (20 tokens, confidence stop at 0.4)."""
    return Transformers(f"hf-assisted-{drafter_name}", hf, eos_ids=eos_ids, sampling=sampling, assistant=assistant,
                        assistant_options=HF_ASSISTED_DEFAULTS, drafter=drafter_name, k="hf-default")


def hf_assisted_heuristic(hf, assistant, eos_ids, sampling, drafter_name, k):
    """The +2 when all accepted / -1 otherwise schedule, reset at each call."""
    return Transformers(f"hf-assisted-{drafter_name}-heuristic", hf, eos_ids=eos_ids, sampling=sampling,
                        assistant=assistant,
                        assistant_options={"num_assistant_tokens": k, "num_assistant_tokens_schedule":
                                           "heuristic_transient", "assistant_confidence_threshold": 0.0},
                        drafter=drafter_name, k=f"heuristic from {k}")


def hf_assisted_constant(hf, assistant, eos_ids, sampling, drafter_name, k):
    return Transformers(f"hf-assisted-{drafter_name}-k{k}", hf, eos_ids=eos_ids, sampling=sampling, assistant=assistant,
                        assistant_options={"num_assistant_tokens": k, "num_assistant_tokens_schedule": "constant",
                                           "assistant_confidence_threshold": 0.0},
                        drafter=drafter_name, k=k)


def hf_prompt_lookup(hf, eos_ids, sampling, k):
    return Transformers(f"hf-prompt-lookup-k{k}", hf, eos_ids=eos_ids, sampling=sampling, prompt_lookup_num_tokens=k,
                        drafter="ngram", k=k)


def hf_generate(hf, eos_ids, sampling):
    name = "hf-greedy" if not sampling.get("temperature") else "hf-sample"
    return Transformers(name, hf, eos_ids=eos_ids, sampling=sampling)


class LlamaCpp(Method):
    """llama.cpp's own greedy generation through llama-cpp-python's `Llama.generate` (the
    decode-and-sample loop `create_completion` runs, without its detokenizing), on a GGUF
    file, optionally with its own speculation (`LlamaPromptLookupDecoding`)."""

    family = "llama.cpp"

    def __init__(self, name, path, *, eos_ids, n_ctx: int, threads: int, lookup_k: int | None = None):
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        from ..models.llamacpp import loading_for_this_cpu

        draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup_k) if lookup_k else None
        self.name, self.eos_ids = name, set(eos_ids)
        self.drafter, self.k = ("ngram", lookup_k) if lookup_k else (None, None)
        with loading_for_this_cpu():
            self.llm = Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_threads=threads,
                             n_threads_batch=threads, draft_model=draft, verbose=False)

    def call(self, prompt_ids, max_tokens):
        self.llm.reset()  # no prompt reuse from the last call: every trial pays its prefill
        out = []
        for token in self.llm.generate(prompt_ids, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
            out.append(int(token))
            if token in self.eos_ids or len(out) >= max_tokens:
                break
        return out, None, None
