"""The native engine's fast path: one C++ call per decoding pass of blocks of up to 32 tokens,
of one sequence or of a batch (kernel.cpp).

Plain decoding and speculative verification both run passes of a few tokens, and on a CPU
those are memory-bound: the pass should cost the time it takes to read the weights once.
torch's bf16 matmuls reach about half that bandwidth at a few rows, and a 30-layer pass
spends several milliseconds more in per-op overhead. The kernel streams each weight row once
for all rows of the block, in one OpenMP team, and computes every row the same way whatever
the block size, so a verification pass scores exactly as the one-token passes would.

It is compiled on first use with the system's C++ compiler (`$CXX`, else g++) into the user
cache, for this CPU: AMX tile products where the CPU has them (Intel Sapphire Rapids and later)
and the OS grants the tiles, else AVX512-BF16 dot products; else AVX2 + FMA ones where it has
those (the portable form vectorized by hand, with its bits); else a portable form the compiler
vectorizes. Without a compiler the engine says so once and uses its pure-torch path.
SPECDEC_KERNEL=off turns the kernel off; SPECDEC_KERNEL=portable builds the portable form
(on x86 for AVX2 + FMA); SPECDEC_KERNEL=avx512 builds this CPU's form without AMX.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("kernel.cpp")
BLOCK = 32  # a sequence's block runs here up to this many tokens (speculation verifies at most 17)
MAX_ROWS = 128  # rows of one pass over several sequences (kernel.cpp's limit)
PER_LAYER = 23  # pointers per layer, in kernel.cpp's order
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
_library: ctypes.CDLL | None | bool = False  # False: not tried yet


def _mode() -> str:
    mode = os.environ.get("SPECDEC_KERNEL", "on").lower()
    if mode not in ("on", "off", "portable", "avx512"):
        raise ValueError(f"SPECDEC_KERNEL must be on, off, portable or avx512, not {mode!r}")
    return mode


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def build(mode: str | None = None) -> Path:
    """Compile kernel.cpp for this CPU into the cache (once per source, compiler and CPU)."""
    from .registry import cache_dir

    mode = mode or _mode()
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    if cxx is None:
        raise FileNotFoundError(f"no C++ compiler: {os.environ.get('CXX', 'g++')!r} is not on PATH")
    flags = list(_FLAGS)
    if mode in ("portable", "avx2"):  # on x86, for AVX2 + FMA exactly, as a CPU without AVX-512 has
        flags[1] = "-march=x86-64-v3" if platform.machine() in ("x86_64", "AMD64") else "-march=native"
    if mode == "portable":  # the plain C++ form every CPU can build, not the AVX2 one written by hand
        flags.append("-DSPECDEC_GENERIC")
    if mode == "avx512":  # this CPU's form without AMX (where the OS refuses the tiles, and for tests)
        flags += ["-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"]
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(flags), version, platform.machine(),
                                    _cpu_flags()]).encode()).hexdigest()[:16]
    out = cache_dir() / "kernels" / key / "libspecdec_kernel.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            tmp_out = Path(tmp) / out.name
            done = subprocess.run([cxx, *flags, str(SOURCE), "-o", str(tmp_out)], capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"{cxx} failed on {SOURCE.name}: {done.stderr.strip()[-2000:]}")
            os.replace(tmp_out, out)  # atomic: a concurrent build never sees half a file
    return out


def load(path: Path) -> ctypes.CDLL:
    """A built kernel library, with its entry points typed."""
    lib = ctypes.CDLL(str(path))
    lib.specdec_isa.restype = ctypes.c_char_p
    lib.specdec_ready.restype = ctypes.c_int
    lib.specdec_pass.restype = ctypes.c_int
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.specdec_pass.argtypes = [p, ctypes.c_float, p, p, p, p, p, p, p, p, p, p, p, i, p, i, p, i]
    lib.specdec_linear.restype = None
    lib.specdec_linear.argtypes = [p, i, i, p, i, p, i]
    return lib


def library() -> ctypes.CDLL | None:
    """The compiled kernel, or None (turned off, or it cannot be built: said once on stderr)."""
    global _library
    if _library is False:
        _library = None
        mode = _mode()
        if mode != "off":
            try:
                _library = load(build(mode))
                if not _library.specdec_ready():  # the AMX form, where Linux refuses the tile state
                    _library = load(build("avx512"))
            except (OSError, RuntimeError) as e:
                print(f"specdec: the native engine's fast kernel is unavailable ({e}); using the slower "
                      f"pure-torch path", file=sys.stderr)
    return _library


def use(lib: ctypes.CDLL | None) -> None:
    """Make `lib` the kernel the native engine calls (None: the pure-torch path). For tests."""
    global _library
    _library = lib


def isa() -> str | None:
    """Which form of the kernel runs here ("amx-bf16", "avx512-bf16", "avx2", "portable"), or None."""
    lib = library()
    return lib.specdec_isa().decode() if lib is not None else None


def tile_rows() -> int | None:
    """Rows the kernel's dot products take at once, or None where a pass grows smoothly with
    its rows. The AMX form multiplies 16 input rows a tile: a pass of 17 pays for a second
    round of tile products (1.56x a one-row pass on the AMX VM, against 1.30x for 16)."""
    return 16 if isa() == "amx-bf16" else None


def supports(module) -> bool:
    """Whether the kernel computes this model: bf16 on the CPU (its projections bf16 or int8),
    in shapes it tiles."""
    c = module.cfg
    w = module.model.embed_tokens.weight
    return (w.dtype == torch.bfloat16 and w.device.type == "cpu" and c.hidden_size % 32 == 0
            and c.intermediate_size % 32 == 0 and c.head_dim % 32 == 0 and c.head_dim <= 256
            and c.num_heads % c.num_kv_heads == 0)


class Plan:
    """Raw pointers to a module's weights, in the kernel's order, built once per module."""

    def __init__(self, module):
        c = module.cfg
        self.tensors = []  # what the pointers point into

        def ptr(t, dtypes=(torch.bfloat16,)) -> int:
            if t is None:
                return 0
            t = t.detach()
            if t.dtype not in dtypes or not t.is_contiguous():
                raise ValueError(f"kernel tensors must be contiguous {' or '.join(map(str, dtypes))}, not {t.dtype}")
            self.tensors.append(t)
            return t.data_ptr()

        def scale(linear) -> int:  # an int8 matrix's block scales (llama.Int8Linear); 0 for bf16
            return ptr(getattr(linear, "scale", None))

        ptrs = []
        for layer in module.model.layers:
            a, f = layer.self_attn, layer.mlp
            matrices = [a.q_proj, a.k_proj, a.v_proj, a.o_proj, f.gate_proj, f.up_proj, f.down_proj]
            weights = [ptr(layer.input_layernorm.weight)] + [ptr(m.weight, (torch.bfloat16, torch.int8)) for m in matrices]
            weights.insert(5, ptr(layer.post_attention_layernorm.weight))
            ptrs += weights + [ptr(m.bias) for m in matrices] + [scale(m) for m in matrices]
        self.layer_ptrs = torch.tensor(ptrs, dtype=torch.uint64)
        self.embed = ptr(module.model.embed_tokens.weight)
        self.final_norm = ptr(module.model.norm.weight)
        self.head = module.lm_head.weight.detach()
        self.head_scale = getattr(module.lm_head, "scale", None)  # an int8 head's block scales, or None
        self.inv_freq = module.inv_freq.float().contiguous()
        self.dims = [c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim, c.num_layers]
        self.eps = c.rms_norm_eps
        self.fingerprint = fingerprint(module)
        self.rows = torch.arange(MAX_ROWS, dtype=torch.int64)  # row indices, sliced by each pass
        self.cfgs: dict[tuple, torch.Tensor] = {}  # the pass's shape arguments, by cache and head


def fingerprint(module) -> tuple:
    """Cheap check that the weights a plan points into are still the module's."""
    m = module.model
    return (m.embed_tokens.weight.data_ptr(), module.lm_head.weight.data_ptr(), m.norm.weight.data_ptr(),
            m.layers[0].self_attn.q_proj.weight.data_ptr(), m.layers[-1].mlp.down_proj.weight.data_ptr())


def plan_for(module) -> Plan:
    plan = getattr(module, "_kernel_plan", None)
    if plan is None or plan.fingerprint != fingerprint(module):
        plan = module._kernel_plan = Plan(module)
    return plan


def passes(seqs: list[int], sizes: list[int]) -> list[list[int]]:
    """Sequences grouped into passes of at most MAX_ROWS rows, in order."""
    groups, rows = [], MAX_ROWS + 1
    for b, n in zip(seqs, sizes):
        if rows + n > MAX_ROWS:
            groups.append([])
            rows = 0
        groups[-1].append(b)
        rows += n
    return groups


def prepare(module, cache, head_rows: torch.Tensor | None) -> tuple[Plan, torch.Tensor, int, torch.Tensor]:
    """A pass's plan, its head rows (checked), their scales' pointer (0: bf16 rows) and its
    shape arguments (kept in the plan)."""
    plan = plan_for(module)
    head, head_scale = (plan.head, plan.head_scale) if head_rows is None else (head_rows, None)
    bf16_rows = head_scale is None
    if (bf16_rows and head.dtype != torch.bfloat16) or not head.is_contiguous() or cache.k.dtype != torch.bfloat16:
        raise ValueError("the kernel runs on contiguous bf16 (or scaled int8) head rows and a bf16 cache")
    key = (cache.capacity, head.shape[0], cache.batch)
    cfg = plan.cfgs.get(key)
    if cfg is None:
        cfg = plan.cfgs[key] = torch.tensor(plan.dims + list(key), dtype=torch.int64)
    return plan, head, 0 if head_scale is None else head_scale.data_ptr(), cfg


def run(lib, module, blocks: list[torch.Tensor], seqs: list[int], cache, last_only: bool,
        head_rows: torch.Tensor | None) -> list[torch.Tensor]:
    """One kernel pass appending blocks[i] to sequence seqs[i] of `cache`; logits per block
    ([T_i, head rows], or its last row with last_only). Does not move the cache's lengths.

    Few lines on purpose: they run after the pass has streamed the weights through the
    caches, so each costs microseconds cold (docs/kernels.md, "What a pass costs around the
    kernel"); what does not change from pass to pass is kept in the plan."""
    plan, head, head_scale, cfg = prepare(module, cache, head_rows)
    if len(blocks) == 1:  # one sequence's block: plain decoding and verification
        tokens, b = blocks[0].contiguous(), seqs[0]
        n = tokens.shape[0]
        seq = torch.full((n,), b, dtype=torch.int64)
        pos = plan.rows[:n] + cache.lengths[b]
        out = plan.rows[n - 1:n] if last_only else plan.rows[:n]
    else:
        sizes = [t.shape[0] for t in blocks]
        tokens = torch.cat(blocks).contiguous()
        seq = torch.tensor([b for b, n in zip(seqs, sizes) for _ in range(n)], dtype=torch.int64)
        pos = torch.tensor([cache.lengths[b] + i for b, n in zip(seqs, sizes) for i in range(n)], dtype=torch.int64)
        ends = torch.tensor(sizes).cumsum(0)
        out = (ends - 1) if last_only else plan.rows[:int(ends[-1])]
    logits = torch.empty((out.shape[0], head.shape[0]), dtype=torch.float32)
    rc = lib.specdec_pass(cfg.data_ptr(), plan.eps, plan.inv_freq.data_ptr(), plan.layer_ptrs.data_ptr(),
                          plan.embed, plan.final_norm, head.data_ptr(), head_scale, cache.k.data_ptr(), cache.v.data_ptr(),
                          tokens.data_ptr(), seq.data_ptr(), pos.data_ptr(), tokens.shape[0], out.data_ptr(),
                          out.shape[0], logits.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"kernel refused a pass of {tokens.shape[0]} rows")
    if len(blocks) == 1:
        return [logits]
    return list(logits.split([1] * len(sizes) if last_only else sizes))


def run_long(lib, module, tokens: torch.Tensor, seq: int, cache, last_only: bool,
             head_rows: torch.Tensor | None) -> torch.Tensor:
    """A block longer than one pass takes (a prompt), appended to sequence `seq` in passes of
    MAX_ROWS rows one after another; its logits ([T, head rows], or the last row). Each row is
    the one-token pass's bits, as in any pass, so a prompt read this way leaves the same cache
    as one read token by token. Moves the sequence's length."""
    out = []
    for piece in tokens.split(MAX_ROWS):  # with last_only, each piece's last row (a 128th more head)
        out.append(run(lib, module, [piece], [seq], cache, last_only, head_rows)[0])
        cache.lengths[seq] += piece.shape[0]
    return out[-1] if last_only else torch.cat(out)
