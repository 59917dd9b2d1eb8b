"""Bad model files get one clear error naming the file, on every engine, in the API and the CLI.

Fuzzing: real files written here (a tiny checkpoint: config.json and safetensors; the same
weights as GGUF) are cut short and have bytes flipped, and each engine is asked to load them.
Each attempt must either load (flipped bytes inside the weights are still weights) or raise
`ModelFileError` (a ValueError) or FileNotFoundError whose message names the file: no parser's
exception, no traceback, no crash.
"""
from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specdec import load_model
from specdec.models.gguf_write import write_gguf
from specdec.models.loading import ModelFileError

from tiny import save_tiny, tiny_gpt2


def _llama_cpp() -> bool:
    try:
        import llama_cpp  # noqa: F401
        return True
    except ImportError:
        return False


ENGINES = ["native"] + (["llama.cpp"] if _llama_cpp() else [])


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))  # conversions of bad files stay here


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    d = tmp_path_factory.mktemp("good")
    llama = save_tiny(d / "llama", "llama", seed=0)
    gpt2 = d / "gpt2"
    tiny_gpt2().save_pretrained(gpt2, safe_serialization=True)  # the transformers adapter's kind
    gguf = write_gguf(llama, d / "tiny.f32.gguf", file_type="f32")
    return {"llama": llama, "gpt2": gpt2, "gguf": gguf}


def refused_or_loaded(source: Path, engine: str) -> str:
    """'loaded' or 'refused'; anything else fails the test."""
    try:
        load_model(source, dtype="float32" if engine == "native" else None, engine=engine)
        return "loaded"
    except (ModelFileError, FileNotFoundError) as exc:
        message = str(exc)
        assert str(source) in message or source.name in message, message
        assert "\n" not in message, message
        return "refused"


def mutations(data: bytes, seed: int, n: int):
    """Cuts at points spread over the file, then single and burst byte flips at random places."""
    rng = random.Random(seed)
    for frac in (0.0, 0.001, 0.01, 0.05, 0.2, 0.6, 0.95, 0.999):
        yield f"cut at {frac}", data[: int(len(data) * frac)]
    head = min(len(data), 4096)  # the header, metadata and tensor table live at the start
    for i in range(n):
        b = bytearray(data)
        where = rng.randrange(head) if i % 2 == 0 else rng.randrange(len(b))
        for j in range(rng.choice([1, 1, 4, 16])):
            if where + j < len(b):
                b[where + j] ^= rng.randrange(1, 256)
        yield f"flip at {where}", bytes(b)


@pytest.mark.parametrize("engine", ENGINES)
def test_fuzzed_gguf_files(good, tmp_path, engine):
    data = good["gguf"].read_bytes()
    outcomes = {}
    for i, (what, bad) in enumerate(mutations(data, seed=1, n=16)):
        path = tmp_path / f"bad{i}.gguf"
        path.write_bytes(bad)
        outcomes[what] = refused_or_loaded(path, engine)
    assert outcomes["cut at 0.0"] == outcomes["cut at 0.6"] == "refused", outcomes


def test_a_gguf_file_is_checked_before_llama_cpp_gets_it(good, tmp_path):
    """What is wrong is named: the header cut, a tensor cut, a key given twice, an unknown type."""
    import struct

    from specdec.models.loading import check_gguf

    data = good["gguf"].read_bytes()
    check_gguf(good["gguf"])

    def refused(bad: bytes, what: str):
        path = tmp_path / "bad.gguf"
        path.write_bytes(bad)
        with pytest.raises(ModelFileError, match=what) as e:
            check_gguf(path)
        assert str(path) in str(e.value)

    refused(data[:100], "header runs past the end")
    refused(data[:int(len(data) * 0.6)], "tensor .* runs past the end of the file")
    refused(data[:4] + struct.pack("<I", 1) + data[8:], "GGUF version 1")
    # The first metadata entry: key length (u64), key, value type (u32), then its string value.
    n = struct.unpack_from("<Q", data, 24)[0]
    assert struct.unpack_from("<I", data, 32 + n)[0] == 8  # a string
    refused(data[:32 + n] + struct.pack("<I", 99) + data[36 + n:], "99 is not a valid GGUFValueType")
    end = 36 + n + 8 + struct.unpack_from("<Q", data, 36 + n)[0]
    n_kv = struct.unpack_from("<Q", data, 16)[0]
    refused(data[:16] + struct.pack("<Q", n_kv + 1) + data[24:end] + data[24:end] + data[end:], "appears twice")


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("engine", ENGINES)
def test_fuzzed_safetensors_and_configs(good, tmp_path, kind, engine):
    if engine == "llama.cpp" and kind == "gpt2":
        pytest.skip("the llama.cpp engine writes GGUF files of Llama-family checkpoints only")
    src = good[kind]
    outcomes = {}
    for name, n in (("model.safetensors", 10), ("config.json", 6)):
        data = (src / name).read_bytes()
        for i, (what, bad) in enumerate(mutations(data, seed=2, n=n)):
            d = tmp_path / f"{name}-{i}"
            shutil.copytree(src, d)
            (d / name).write_bytes(bad)
            outcomes[f"{name} {what}"] = refused_or_loaded(d, engine)
    assert outcomes["model.safetensors cut at 0.6"] == outcomes["config.json cut at 0.6"] == "refused", outcomes


@pytest.mark.parametrize("engine", ENGINES)
def test_incomplete_checkpoints(good, tmp_path, engine):
    # A config without the model's sizes, beside only a pickled checkpoint (never unpickled).
    d = tmp_path / "pickled"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 64}))
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04not read")
    with pytest.raises(ModelFileError, match="pickled .bin checkpoints are refused"):
        load_model(d, engine=engine)
    # Sizes missing from an otherwise good checkpoint.
    e = shutil.copytree(good["llama"], tmp_path / "no-heads")
    config = json.loads((e / "config.json").read_text())
    del config["num_attention_heads"], config["hidden_size"]
    (e / "config.json").write_text(json.dumps(config))
    assert refused_or_loaded(e, engine) == "refused"


def test_the_cli_says_one_line_and_exits_2(good, tmp_path):
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(good["gguf"].read_bytes()[:2000])
    for engine in ENGINES:
        out = subprocess.run([sys.executable, "-m", "specdec.cli", "generate", "--model", str(bad), "--engine", engine,
                              "--max-tokens", "2", "hello"], capture_output=True, text=True, timeout=300,
                             env={**__import__("os").environ, "SPECDEC_CACHE": str(tmp_path / "cache")})
        assert out.returncode == 2, out.stderr
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("specdec: error: ") and str(bad) in lines[0], out.stderr
