"""The benchmark's prompt suite: load, validate, select, render to token ids."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

SUITE_DIR = Path(__file__).parent / "prompts"
DEFAULT_SUITE = SUITE_DIR / "suite-v1.jsonl"
# Categories whose answers copy spans of the prompt (our suite's, and Spec-Bench's "extraction").
GROUNDED = {"summarization", "rag", "code_editing", "extraction"}
# Earlier assistant turns of a multi-turn prompt are the target's own greedy replies, this long.
HISTORY_TOKENS = 48


@dataclass
class Prompt:
    id: str
    category: str
    turns: list[str]
    grounded: bool
    ids: list[int] = field(default_factory=list)  # rendered, filled by render()


def load_suite(path=None, categories=None, per_category=None) -> list[Prompt]:
    """Read a JSONL suite: per line {"category", "turns", optional "id", "grounded"}, or
    Spec-Bench's question.jsonl form {"question_id": int, "category", "turns", ...} (other
    fields, such as a reference answer, are ignored)."""
    path = Path(path) if path else DEFAULT_SUITE
    if not path.exists():
        raise FileNotFoundError(f"no such prompt file: {path}")
    prompts = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: not valid JSON ({exc.msg})") from None
        turns = row.get("turns")
        if "prompt" in row and turns is None:
            turns = [row["prompt"]]
        if not isinstance(row.get("category"), str) or not turns or not all(isinstance(t, str) and t for t in turns):
            raise ValueError(f"{path}:{n}: needs a 'category' string and non-empty 'turns' strings")
        cat, qid = row["category"], row.get("question_id")
        if qid is not None and (not isinstance(qid, int) or isinstance(qid, bool)):
            raise ValueError(f"{path}:{n}: 'question_id' must be an integer, got {qid!r}")
        pid = str(row.get("id", qid if qid is not None else f"{cat}-{n:03d}"))
        if any(p.id == pid for p in prompts):
            raise ValueError(f"{path}:{n}: duplicate prompt id {pid!r}")
        prompts.append(Prompt(id=pid, category=cat, turns=list(turns),
                              grounded=bool(row.get("grounded", cat in GROUNDED))))
    if categories:
        unknown = set(categories) - {p.category for p in prompts}
        if unknown:
            raise ValueError(f"unknown categories {sorted(unknown)}; the suite has {sorted({p.category for p in prompts})}")
        prompts = [p for p in prompts if p.category in categories]
    if per_category:
        seen: dict[str, int] = {}
        kept = []
        for p in prompts:
            seen[p.category] = seen.get(p.category, 0) + 1
            if seen[p.category] <= per_category:
                kept.append(p)
        prompts = kept
    if not prompts:
        raise ValueError(f"{path}: no prompts selected")
    return prompts


def plain_dialogue(messages) -> str:
    """A conversation as a base model reads it best: "User: ...", "Assistant: ..." lines,
    ending where the assistant is to write."""
    lines = [f"{'User' if m['role'] == 'user' else 'Assistant'}: {m['content']}" for m in messages]
    return "\n".join(lines) + "\nAssistant:"


def render(prompts: list[Prompt], model, tokenizer) -> None:
    """Fill each prompt's token ids with the chat template (for a tokenizer without one, a
    base model's: `plain_dialogue`). For a multi-turn prompt the earlier assistant turns are
    the target's own greedy replies, so the history is one the target would have produced."""
    from ..decoding import generate

    chat = bool(getattr(tokenizer, "chat_template", None))
    for p in prompts:
        messages = []
        for i, turn in enumerate(p.turns):
            messages.append({"role": "user", "content": turn})
            if chat:
                text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
                ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            else:  # a base model: the conversation as plain text, with the tokenizer's own BOS
                ids = tokenizer(plain_dialogue(messages))["input_ids"]
            if i < len(p.turns) - 1:
                reply = generate(model, tokenizer, ids, HISTORY_TOKENS)
                messages.append({"role": "assistant", "content": reply.text.strip()})
        p.ids = ids
