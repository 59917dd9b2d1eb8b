"""Finding and loading models: embedded names, checkpoint directories, GGUF files.

Nothing here downloads. Embedded models ship inside pip packages (GGUF) and are converted
once into a user cache directory as a standard transformers checkpoint (config.json +
safetensors + tokenizer), so later loads take about a second and other tools can load
the same weights (`hf_checkpoint`). Only safetensors and GGUF are read: never pickles.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from contextlib import contextmanager
from pathlib import Path

import torch

from .base import LanguageModel, eos_ids_of
from .hf import HFAdapter
from .llama import Llama, LlamaConfig, quantize_int8, rope_inv_freq
from .native import NativeLM
from .pages import to_huge_pages
from .registry import (DEFAULT_MODEL, EMBEDDED_GGUF, HEAD_TOKENS_FILE, LLAMA_CPP_ONLY, SHIPPED_DRAFTS,
                       TOKENIZER_FILES, WHY_LLAMA_CPP_ONLY, assembled_gguf, cache_dir,
                       embedded_gguf_path)

# "int8": the native engine's projections and head as int8 with a bf16 scale per 32 weights, computed in
# bf16 (llama.Int8Linear); on the llama.cpp engine, a Q8_0 file.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.int8}


class ModelFileError(ValueError):
    """A model file or checkpoint that cannot be read as one (cut short, corrupt, incomplete);
    the message names it."""


@contextmanager
def reading(source):
    """Any failure while reading `source` becomes one ModelFileError naming it: a user sees
    "PATH: what is wrong", never a parser's traceback. Missing files stay FileNotFoundError."""
    try:
        yield
    except (FileNotFoundError, ModelFileError):
        raise
    except Exception as exc:  # noqa: BLE001 -- whatever the parsers raise on bad bytes
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if str(source) not in message:
            message = f"{source}: cannot read it as a model: {message}"
        raise ModelFileError(message) from exc


def check_gguf(path: Path) -> None:
    """Refuse a GGUF file whose header, metadata or tensor table does not hold together, or
    whose tensors run past its end, before llama.cpp is handed it. The header is walked with
    struct rather than gguf's GGUFReader, which builds a numpy view per array item: for
    Gemma-3's 262k-token vocabulary about 33 s against 0.3 s (one Zen 3 core)."""
    import mmap
    import struct

    from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType

    scalar = {GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
              GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i", GGUFValueType.FLOAT32: "f",
              GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q",
              GGUFValueType.FLOAT64: "d"}
    size = path.stat().st_size
    if size < 24:
        raise ModelFileError(f"{path}: {size} bytes, shorter than a GGUF header (cut short?)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        pos = 0

        def take(fmt: str):
            nonlocal pos
            values = struct.unpack_from("<" + fmt, buf, pos)
            pos += struct.calcsize("<" + fmt)
            return values if len(values) > 1 else values[0]

        def skip(n: int) -> None:
            nonlocal pos
            pos += n
            if pos > size:
                raise struct.error("past the end")

        def text() -> str:
            n = take("Q")
            skip(n)
            return bytes(buf[pos - n:pos]).decode("utf-8")

        def skip_values(kind: int, count: int) -> None:
            kind = GGUFValueType(kind)  # ValueError on an unknown type
            if kind in scalar:
                skip(count * struct.calcsize(scalar[kind]))
            elif kind == GGUFValueType.STRING:
                for _ in range(count):
                    skip(take("Q"))
            else:  # ARRAY: item type, length, items
                for _ in range(count):
                    skip_values(*take("IQ"))

        # An unknown value or tensor type, a name that is not UTF-8: reading() names the file.
        with reading(path):
            try:
                magic, version, n_tensors, n_kv = take("IIQQ")
                if magic != GGUF_MAGIC:
                    raise ModelFileError(f"{path}: not a GGUF file (no GGUF magic)")
                if version not in (2, 3):
                    raise ModelFileError(f"{path}: GGUF version {version}; llama.cpp here reads versions 2 and 3")
                keys, alignment = set(), GGUF_DEFAULT_ALIGNMENT
                for _ in range(n_kv):
                    key, kind = text(), take("I")
                    if key in keys:
                        raise ModelFileError(f"{path}: metadata key {key} appears twice")
                    keys.add(key)
                    if key == "general.alignment":
                        if kind != GGUFValueType.UINT32:
                            raise ModelFileError(f"{path}: general.alignment is not a uint32")
                        alignment = take("I")
                        if alignment == 0 or alignment & (alignment - 1):
                            raise ModelFileError(f"{path}: alignment {alignment} is not a power of two")
                    else:
                        skip_values(kind, 1)
                tensors = []
                for _ in range(n_tensors):
                    name, n_dims = text(), take("I")
                    if n_dims > 4:  # GGML_MAX_DIMS
                        raise ModelFileError(f"{path}: tensor {name} has {n_dims} dimensions")
                    dims = struct.unpack_from(f"<{n_dims}Q", buf, pos)
                    skip(8 * n_dims)
                    kind, offset = GGMLQuantizationType(take("I")), take("Q")
                    tensors.append((name, dims, kind, offset))
            except struct.error:
                raise ModelFileError(f"{path}: its header runs past the end of the file (cut short?)") from None
        data_start = -(-pos // alignment) * alignment
    if not tensors:
        raise ModelFileError(f"{path}: a GGUF file without tensors")
    if len({name for name, *_ in tensors}) < len(tensors):
        raise ModelFileError(f"{path}: a tensor name appears twice")
    for name, dims, kind, offset in tensors:
        block, type_size = GGML_QUANT_SIZES[kind]
        if (dims[0] if dims else 1) % block or offset % alignment:
            raise ModelFileError(f"{path}: tensor {name}'s shape or offset does not fit its type {kind.name}")
        if data_start + offset + math.prod(dims) // block * type_size > size:
            raise ModelFileError(f"{path}: tensor {name} runs past the end of the file (cut short?)")


# Bumped whenever what a GGUF conversion writes changes (2: config.json names its
# architecture), so that a conversion cached by an older specdec is redone.
CONVERSION_VERSION = "2"
CONVERSION_STAMP = "specdec-conversion"


def _convert_once(gguf: Path, out: Path) -> Path:
    stamp = out / CONVERSION_STAMP
    if not (stamp.exists() and stamp.read_text() == CONVERSION_VERSION):
        from .gguf_convert import convert_gguf

        convert_gguf(gguf, out)
        stamp.write_text(CONVERSION_VERSION)
    return out


def hf_checkpoint(name_or_path: str | os.PathLike) -> Path:
    """A local directory that transformers' `from_pretrained` loads, for any name load_model takes."""
    key = str(name_or_path)
    if key in LLAMA_CPP_ONLY:
        raise ValueError(f"{key} has no transformers checkpoint here: it runs on the llama.cpp engine only "
                         f"({WHY_LLAMA_CPP_ONLY[key]})")
    if key in EMBEDDED_GGUF:
        return _convert_once(embedded_gguf_path(key), cache_dir() / key)
    if key in SHIPPED_DRAFTS:
        source, target = SHIPPED_DRAFTS[key]
        return materialize_draft(source, hf_checkpoint(target), cache_dir() / key)
    path = Path(key).expanduser()
    if not path.exists():
        names = sorted([*EMBEDDED_GGUF, *SHIPPED_DRAFTS])
        raise FileNotFoundError(f"no such model: {key!r} (not an embedded name: {names})")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path}: model files must be a .gguf file or a checkpoint directory")
        stat = path.stat()
        tag = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
        return _convert_once(path, cache_dir() / "gguf" / f"{path.stem}-{tag}")
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path}: no config.json; expected a transformers checkpoint directory")
    return path


def read_tensor(checkpoint: Path, name: str) -> torch.Tensor:
    from safetensors import safe_open

    for f in _safetensors_files(checkpoint):
        with safe_open(str(f), framework="pt") as st:
            if name in st.keys():
                return st.get_tensor(name)
    raise ValueError(f"{checkpoint} has no tensor {name!r}")


def tensor_digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def materialize_draft(source: Path, target: Path, out: Path) -> Path:
    """Join a shipped draft's layers with its target's embeddings into a full checkpoint.

    `source` holds config.json, layers.safetensors and shared.json (which target tensors it
    shares, with their sha256, so a draft never runs on weights it was not trained with).
    Redone whenever the shipped layers (or head token list) change; written atomically.
    """
    import shutil

    from safetensors.torch import load_file, save_file

    layers = source / "layers.safetensors"
    if not layers.exists():
        raise FileNotFoundError(f"{layers} is missing from the installed package")
    head = source / HEAD_TOKENS_FILE
    stamp = hashlib.sha256(layers.read_bytes() + (head.read_bytes() if head.exists() else b"")).hexdigest()
    if (out / "source.sha256").exists() and (out / "source.sha256").read_text() == stamp:
        return out
    shared = json.loads((source / "shared.json").read_text())["sha256"]
    state = load_file(str(layers))
    dtype = next(iter(state.values())).dtype
    for name, digest in shared.items():
        weight = read_tensor(target, name)
        if tensor_digest(weight) != digest:
            raise ValueError(f"{target} does not hold the {name} that {source.name} was trained with")
        state[name] = weight.to(dtype)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(source / "config.json", tmp / "config.json")
    for name in TOKENIZER_FILES:
        if (target / name).exists():
            shutil.copy(target / name, tmp / name)
    for extra in source.iterdir():  # notice, recipe and training log travel with the weights
        if extra.suffix in (".md", ".jsonl", ".txt") or extra.name in ("NOTICE", "recipe.json", HEAD_TOKENS_FILE):
            shutil.copy(extra, tmp / extra.name)
    (tmp / "source.sha256").write_text(stamp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def resolve_dtype(dtype, device, native: bool = True) -> torch.dtype:
    """`dtype` as a torch.dtype; None: the fastest here for the native engine (`native`) or for
    a model run through transformers."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None:
        return torch.bfloat16 if _bf16_is_fast(torch.device(device), native) else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)} or a torch.dtype, got {dtype!r}")
    return DTYPES[dtype]


def _bf16_is_fast(device: torch.device, native: bool) -> bool:
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    # The native engine's kernel runs bf16 on any CPU it builds for, at half fp32's memory
    # traffic (on an AVX2-only Zen 3 VM about 5x faster a token than fp32 through torch,
    # docs/kernels.md). Without it, torch's bf16 matmuls on a CPU without bf16 instructions
    # are emulated, slower than fp32.
    from . import kernel

    if native and kernel.library() is not None:
        return True
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def load_tokenizer(name_or_path):
    """The checkpoint's tokenizer (with its chat template), or None if it ships none."""
    from transformers import AutoTokenizer

    path = hf_checkpoint(name_or_path)
    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    return AutoTokenizer.from_pretrained(str(path))


def _safetensors_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors weights (pickled .bin checkpoints are refused)")
    return files


def _read_config(path: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path), trust_remote_code=False)


def _generation_eos(path: Path, config, tokenizer) -> tuple[int, ...]:
    gen_file = path / "generation_config.json"
    gen = json.loads(gen_file.read_text()) if gen_file.exists() else {}
    ids = set(eos_ids_of(config, tokenizer))
    eos = gen.get("eos_token_id")
    if eos is not None:
        ids.update([eos] if isinstance(eos, int) else eos)
    return tuple(sorted(ids))


ENGINES = ("native", "llama.cpp")
GGUF_FILE_TYPES = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32", torch.int8: "q8_0"}


def load_model(name_or_path=DEFAULT_MODEL, *, dtype=None, device="cpu", engine="native") -> LanguageModel:
    """Load a model by embedded name, checkpoint directory or .gguf file.

    engine="native": Llama-family checkpoints run on our implementation (static KV cache);
    any other architecture runs through transformers behind `HFAdapter`.
    engine="llama.cpp": a .gguf file runs as it is (its own tensor types, any architecture
    llama.cpp runs); an embedded name or a checkpoint directory is first written once as a
    GGUF file in `dtype` (bf16 by default), from the same weights the native engine loads.
    """
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if engine == "llama.cpp":
        return load_llama_cpp(name_or_path, dtype=dtype, device=device)
    if str(name_or_path) in LLAMA_CPP_ONLY:
        raise ValueError(f"{name_or_path} runs on the llama.cpp engine only (engine='llama.cpp'): "
                         f"{WHY_LLAMA_CPP_ONLY[str(name_or_path)]}")
    resolve_dtype(dtype, device)  # a bad dtype is refused before anything is read
    with reading(name_or_path):
        return _load_native(name_or_path, dtype, device)


def _load_native(name_or_path, dtype, device) -> LanguageModel:
    path = hf_checkpoint(name_or_path)
    config = _read_config(path)
    tokenizer = load_tokenizer(path)
    files = _safetensors_files(path)
    name = str(name_or_path)
    try:
        cfg = LlamaConfig.from_hf(config)
    except ValueError:
        cfg = None
    torch_dtype = resolve_dtype(dtype, device, native=cfg is not None)
    if cfg is None and torch_dtype == torch.int8:
        raise ValueError(f"dtype int8 runs Llama-family models on the native engine; {name} is a "
                         f"{config.model_type} model (or engine='llama.cpp' for a Q8_0 file)")
    if cfg is None:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype, use_safetensors=True,
                                                  trust_remote_code=False).to(device)
        return HFAdapter(hf, tokenizer=tokenizer, name=name)
    lm = NativeLM(build_llama(cfg, files, torch_dtype, device), tokenizer=tokenizer, name=name,
                  eos_token_ids=_generation_eos(path, config, tokenizer))
    if (path / HEAD_TOKENS_FILE).exists():
        lm.head_tokens = json.loads((path / HEAD_TOKENS_FILE).read_text())["token_ids"]
    return lm


def gguf_for(name_or_path, dtype=None, file_type: str | None = None) -> Path:
    """The GGUF file the llama.cpp engine runs for `name_or_path`: a .gguf path as it is;
    for an embedded name or a checkpoint directory, a file written once into the cache in
    `dtype` (default bfloat16) or `file_type` ("q8_0", "q4_0", gguf_write.FILE_TYPES), with the
    embedded target's tokenizer metadata where it shares it."""
    key = str(name_or_path)
    if key in LLAMA_CPP_ONLY:
        return assembled_gguf(key)  # its own quantized file, as it comes
    path = Path(key).expanduser()
    if key not in EMBEDDED_GGUF and key not in SHIPPED_DRAFTS and path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path}: the llama.cpp engine runs .gguf files or checkpoint directories")
        return path
    checkpoint = hf_checkpoint(key)
    file_type = file_type or GGUF_FILE_TYPES[resolve_dtype(dtype or "bfloat16", "cpu")]
    target = SHIPPED_DRAFTS[key][1] if key in SHIPPED_DRAFTS else key if key in EMBEDDED_GGUF else None
    files = _safetensors_files(checkpoint) + [checkpoint / "config.json"]
    stamp = ";".join(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)
    tag = hashlib.sha256(f"{checkpoint.resolve()};{stamp};{CONVERSION_VERSION}".encode()).hexdigest()[:12]
    out = cache_dir() / "gguf-written" / f"{checkpoint.name}-{tag}.{file_type}.gguf"
    if not out.exists():
        from .gguf_write import write_gguf

        out.parent.mkdir(parents=True, exist_ok=True)
        write_gguf(checkpoint, out, file_type=file_type,
                   metadata_from=embedded_gguf_path(target) if target else None)
        for stale in out.parent.glob(f"{checkpoint.name}-*.{file_type}.gguf"):  # from weights since replaced
            if stale != out:
                stale.unlink(missing_ok=True)
    return out


def load_llama_cpp(name_or_path, *, dtype=None, device="cpu") -> LanguageModel:
    from .llamacpp import LlamaCppLM, llama_cpp

    if torch.device(device).type != "cpu":
        raise ValueError(f"the llama.cpp engine runs on the CPU here, not {device!r}")
    llama_cpp()  # a missing extra fails before any conversion
    with reading(name_or_path):
        path = gguf_for(name_or_path, dtype)
        check_gguf(path)
        key = str(name_or_path)
        if key in LLAMA_CPP_ONLY:
            tokenizer = _gguf_tokenizer(path, cache_dir() / "gguf-assembled" / f"{key}-tokenizer")
        elif path == Path(key).expanduser():  # a GGUF file of the user's: its tokenizer, if transformers reads it
            tokenizer = _gguf_tokenizer(path)
        else:
            tokenizer = load_tokenizer(hf_checkpoint(key))
        # A draft's head-token list (see ModelDrafter) has no GGUF form: llama.cpp scores the full head.
        return LlamaCppLM(path, tokenizer=tokenizer, name=key)


def _gguf_tokenizer(path: Path, saved: Path | None = None):
    """The tokenizer a GGUF file carries, as transformers reads it (None where it cannot);
    with `saved`, read once and kept there (reading a 262k vocabulary takes seconds)."""
    from transformers import AutoTokenizer

    if saved is not None and (saved / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(str(saved))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception:  # noqa: BLE001 -- an architecture transformers cannot read: token ids only
        return None
    if saved is not None:
        tokenizer.save_pretrained(str(saved))
    return tokenizer


def build_llama(cfg: LlamaConfig, files, dtype, device) -> Llama:
    """The checkpoint as our Llama in `dtype`; torch.int8: read in bf16, then quantized
    (llama.quantize_int8). CPU weights end on 2 MB pages (pages.py)."""
    from safetensors.torch import load_file

    int8, paged = dtype == torch.int8, torch.device(device).type == "cpu"
    with torch.device("meta"):
        module = Llama(cfg)
    state = {}
    for f in files:
        state.update(load_file(str(f), device=str(device)))
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    state = {k: v.to(torch.bfloat16 if int8 else dtype) for k, v in state.items()}
    if paged and not int8:  # int8 weights are paged once quantized, below
        state = to_huge_pages(state)
    missing, unexpected = module.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if not (cfg.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match a {cfg.num_layers}-layer Llama: "
                         f"missing {missing[:3]}, unexpected {unexpected[:3]}")
    if cfg.tie_word_embeddings:
        module.lm_head.weight = module.model.embed_tokens.weight
    if int8:  # the head gets its own int8 copy, so nothing is tied after this
        quantize_int8(module)
        if paged:
            module.load_state_dict(to_huge_pages(module.state_dict()), assign=True)
    # The rotary buffer was built on the meta device; compute it for real.
    module.inv_freq = rope_inv_freq(cfg).to(device)
    return module.eval()
