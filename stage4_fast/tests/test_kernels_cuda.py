"""The CUDA copy kernels: their sources compile with nvcc (when present), and the CPU path (the torch reference)
has the semantics the kernels implement."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

from stage4_fast.kernel import indexing, store_cache
from stage4_fast.kernel.jit import CSRC, CUDA_SOURCES


@pytest.mark.parametrize("source", CUDA_SOURCES)
def test_cuda_source_compiles_with_nvcc(source, tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not on PATH: the CUDA source is built only where CUDA is installed")
    cmd = [nvcc, "-c", "-O3", "-std=c++17", "-arch=sm_90", "-I", str(CSRC), str(CSRC / source), "-o",
           str(tmp_path / "out.o")]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "out.o").stat().st_size > 0


def test_store_cache_writes_only_the_given_slots_from_strided_rows():
    num_slots, heads, dim = 20, 2, 8
    k_cache = torch.zeros(num_slots, heads, dim)
    v_cache = torch.zeros(num_slots, heads, dim)
    qkv = torch.randn(3, (4 + 2 * heads) * dim)  # k and v are column slices of a fused projection
    k = qkv[:, 4 * dim : (4 + heads) * dim].view(3, heads, dim)
    v = qkv[:, (4 + heads) * dim :].view(3, heads, dim)
    slots = torch.tensor([7, 2, 19], dtype=torch.int32)
    store_cache(k_cache, v_cache, slots, k, v)
    assert torch.equal(k_cache[slots.long()], k) and torch.equal(v_cache[slots.long()], v)
    untouched = torch.ones(num_slots, dtype=torch.bool)
    untouched[slots.long()] = False
    assert (k_cache[untouched] == 0).all() and (v_cache[untouched] == 0).all()


def test_indexing_with_vocab_range_zeroes_rows_outside_the_shard():
    table = torch.randn(5, 4)  # rank 1 of a 10-row vocabulary split in two: global rows 5..9
    ids = torch.tensor([0, 5, 9, 7, 4], dtype=torch.int32)
    out = indexing(table, ids, vocab_range=(5, 5))
    expected = torch.stack([torch.zeros(4), table[0], table[4], table[2], torch.zeros(4)])
    assert torch.equal(out, expected)
    assert torch.equal(indexing(table, torch.tensor([3, 1])), table[[3, 1]])


def test_indexing_short_last_shard_ignores_padding_rows():
    """V=10 over 4 ranks: shards of 3 rows, the last holds one real row (9) and two zero padding rows."""
    table = torch.cat([torch.randn(1, 4), torch.zeros(2, 4)])
    ids = torch.arange(10)
    out = indexing(table, ids, vocab_range=(9, 1))
    assert torch.equal(out[9], table[0]) and (out[:9] == 0).all()
