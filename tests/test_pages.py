"""Weights and caches on 2 MB pages (specdec/models/pages.py): the same values, shared storage
kept shared, and, where Linux gives transparent huge pages on request, really on them."""
import mmap
from pathlib import Path

import pytest
import torch

from specdec.models import pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_kb_at(ptr: int) -> int:
    """AnonHugePages of the mapping holding address ptr (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= ptr < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {ptr:#x}")


def test_copies_keep_values_shapes_and_sharing():
    a = torch.randn(300, 7).to(torch.bfloat16)
    b = torch.arange(10, dtype=torch.int64)
    moved = pages.to_huge_pages({"a": a, "tied": a, "b": b, "empty": torch.zeros(0)})
    assert torch.equal(moved["a"], a) and torch.equal(moved["b"], b) and moved["empty"].numel() == 0
    assert moved["a"].data_ptr() == moved["tied"].data_ptr() != a.data_ptr()
    assert all(t.is_contiguous() and t.data_ptr() % 64 == 0 for t in moved.values())
    assert moved["a"].data_ptr() % pages.HUGE == 0


def test_zeros():
    z = pages.zeros((3, 5, 7), torch.bfloat16)
    assert z.shape == (3, 5, 7) and z.dtype == torch.bfloat16 and not z.any()
    z[1, 2, 3] = 4
    assert z.sum() == 4


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages here")
def test_on_huge_pages_where_linux_gives_them():
    t = pages.zeros((8 << 20,), torch.uint8)
    t.fill_(1)  # pages are given on first touch
    assert huge_kb_at(t.data_ptr()) >= 4096
    m = mmap.mmap(-1, 8 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_NOHUGEPAGE)  # not torch's allocator: glibc may put large blocks on huge pages
    ordinary = torch.frombuffer(m, dtype=torch.uint8)
    ordinary.fill_(1)
    assert huge_kb_at(ordinary.data_ptr()) == 0  # the check itself tells them apart


def test_native_weights_and_cache_live_there(tmp_path):
    import specdec
    from tiny import save_tiny

    model = specdec.load_model(str(save_tiny(tmp_path / "m", "llama-tied")))
    w = model.module.lm_head.weight
    assert w is model.module.model.embed_tokens.weight  # tied weights stay one tensor
    ptrs = sorted(p.data_ptr() for p in model.module.parameters())
    assert ptrs[0] % pages.HUGE == 0  # one arena, 2 MB aligned, holds them all
    assert ptrs[-1] - ptrs[0] < sum(p.numel() * p.element_size() + 64 for p in model.module.parameters())
    model.reset(64)
    assert model.cache.k.data_ptr() % pages.HUGE == 0 and model.cache.v.data_ptr() % pages.HUGE == 0
