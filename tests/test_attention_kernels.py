"""The one-row attention kernels (layers/attention.py, attend_row_by_row): close to a float64 reference for chain
and tree rows on both sides of the slot count where a bf16 cache switches from fp32 SDPA to bf16 products, and
a row's bits the same whatever is computed beside it, in place or gathered; on an AVX2-only CPU, an fp32 cache."""
import pytest
import torch

from specserve.drafting.tree import Tree
from specserve.layers.attention import (BF16_PRODUCTS_MIN_SLOTS, attend_one_row, dequantize_kv, kv_cache_dtype,
                                       paged_attention, quantize_kv)
from specserve.layers.kernels import attend_row_native, attend_row_library
from specserve.runtime.model_runner import ForwardItem, ModelRunner

HKV, G, D, BLOCK = 3, 3, 64, 16
LENGTHS = (5, 300, BF16_PRODUCTS_MIN_SLOTS - 3, BF16_PRODUCTS_MIN_SLOTS + 1, 2000)   # contexts before a step


def runner(dtype: torch.dtype, num_blocks: int = 160, kv_kind: str = "auto") -> ModelRunner:
    return ModelRunner(None, 1, HKV, D, num_blocks, BLOCK, dtype, row_by_row=True, kv_kind=kv_kind)


def attend(r: ModelRunner, items: list[ForwardItem], q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    _, _, ctx = r.prepare(items)
    return paged_attention(q, kv[:, 0], kv[:, 1], ctx, 0)


def inputs(n: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [n, Hq, D], kv [n, 2, Hkv, D]; queries 3x a unit vector's scale, so that a few scores stand out."""
    g = torch.Generator().manual_seed(seed)
    q = 3 * torch.randn(n, HKV * G, D, generator=g)
    return q.to(dtype), torch.randn(n, 2, HKV, D, generator=g).to(dtype)


def reference(q: torch.Tensor, kv: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """One row in float64: q [Hq, D] over the context entries `seen` of kv [n, 2, Hkv, D] -> [Hq, D]."""
    k, v = (kv[seen, i].double().transpose(0, 1) for i in (0, 1))                    # [Hkv, T, D]
    scores = q.double().view(HKV, G, D) @ k.transpose(1, 2) / D ** 0.5                 # [Hkv, G, T]
    return (scores.softmax(-1) @ v).reshape(HKV * G, D)


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, num_seen: int) -> None:
    """fp32: summation order; bf16 below the switch: the output's own rounding (2^-9); past it also the scores'
    rounding to bf16, which these sharp rows (scores of std 3) turn into up to ~2% of the largest output."""
    tol = 1e-5 if dtype == torch.float32 else 4e-2 if num_seen >= BF16_PRODUCTS_MIN_SLOTS else 5e-3
    err, scale = (out.double() - ref).abs().max().item(), ref.abs().max().item()
    assert err <= tol * scale, (err, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_ctx", LENGTHS)
def test_chain_and_tree_rows_are_close_to_float64(dtype, n_ctx):
    q, kv = inputs(n_ctx + 6, dtype, n_ctx)
    table = list(range(-(-(n_ctx + 6) // BLOCK)))
    r = runner(dtype)
    attend(r, [ForwardItem(table, 0, list(range(n_ctx)))], q[:n_ctx], kv[:n_ctx])
    chain = attend(r, [ForwardItem(table, n_ctx, [0] * 6)], q[n_ctx:], kv[n_ctx:])
    for i in range(6):
        assert_close(chain[i], reference(q[n_ctx + i], kv, torch.arange(n_ctx + i + 1)), dtype, n_ctx + i + 1)
    tree = Tree([-1, 0, 0, 1, 2, 3])
    out = attend(r, [ForwardItem(table, n_ctx, [0] * 6, tree_mask=tree.attn_mask)], q[n_ctx:], kv[n_ctx:])
    for i, row in enumerate(tree.attn_mask):
        seen = torch.cat((torch.arange(n_ctx), n_ctx + torch.nonzero(row).view(-1)))
        assert_close(out[i], reference(q[n_ctx + i], kv, seen), dtype, len(seen))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_has_the_same_bits_alone_in_a_verify_step_beside_a_batch_in_place_or_gathered(dtype):
    """Decoded one by one, the context is one run of blocks until the step's last token needs block 50, which
    does not follow: the verify step gathers what the decode steps read in place. Each row crosses the slot
    count where the kernel changes (the same kernel for a row either way: it depends on the row's own count)."""
    n_ctx, n_new = BF16_PRODUCTS_MIN_SLOTS - 2, 6
    blocks = -(-(n_ctx + n_new) // BLOCK)
    table = list(range(blocks - 1)) + [50]
    assert (n_ctx + 1) // BLOCK < blocks - 1 and (n_ctx + n_new - 1) // BLOCK == blocks - 1
    q, kv = inputs(n_ctx + n_new, dtype, 7)
    other_q, other_kv = inputs(40, dtype, 8)
    decode, verify, batch = runner(dtype), runner(dtype), runner(dtype)
    for r in (decode, verify, batch):
        attend(r, [ForwardItem(table, 0, list(range(n_ctx)))], q[:n_ctx], kv[:n_ctx])
    attend(batch, [ForwardItem([100, 101, 102], 0, list(range(39)))], other_q[:39], other_kv[:39])
    alone = []
    for i in range(n_ctx, n_ctx + n_new):
        _, _, ctx = decode.prepare([ForwardItem(table, i, [0])])
        assert (ctx.row_by_row[0].run_start is None) == (i // BLOCK == blocks - 1)
        alone.append(attend(decode, [ForwardItem(table, i, [0])], q[i:i + 1], kv[i:i + 1]))
    alone = torch.cat(alone)
    at_once = attend(verify, [ForwardItem(table, n_ctx, [0] * n_new)], q[n_ctx:], kv[n_ctx:])
    assert torch.equal(at_once, alone)
    beside = attend(batch, [ForwardItem([100, 101, 102], 39, [0]), ForwardItem(table, n_ctx, [0] * n_new)],
                    torch.cat((other_q[39:], q[n_ctx:])), torch.cat((other_kv[39:], kv[n_ctx:])))
    assert torch.equal(beside[1:], alone)


def test_cache_dtype_follows_the_cpu(monkeypatch):
    from specserve.layers.linear import bf16_packing_supported
    native = bf16_packing_supported()
    assert kv_cache_dtype(torch.bfloat16, "cpu") == (torch.bfloat16 if native else torch.float32)
    assert kv_cache_dtype(torch.bfloat16, "cuda") == torch.bfloat16
    assert kv_cache_dtype(torch.float32, "cpu") == torch.float32
    from cpu_features import without_bf16_onednn
    without_bf16_onednn(monkeypatch)
    assert kv_cache_dtype(torch.bfloat16, "cpu") == torch.float32


@pytest.mark.parametrize("n_ctx", (300, BF16_PRODUCTS_MIN_SLOTS + 1))
def test_a_bf16_model_on_an_avx2_cpu_attends_over_an_fp32_cache(monkeypatch, n_ctx):
    """As on an AVX2-only CPU: a bf16 model's K/V are kept in fp32 (the exact bf16 values) and attended in fp32."""
    from cpu_features import without_bf16_onednn
    without_bf16_onednn(monkeypatch)
    q, kv = inputs(n_ctx + 3, torch.bfloat16, 3)
    r = runner(torch.bfloat16)
    assert r.kv_cache.dtype == torch.float32
    table = list(range(-(-(n_ctx + 3) // BLOCK)))
    attend(r, [ForwardItem(table, 0, list(range(n_ctx)))], q[:n_ctx], kv[:n_ctx])
    out = attend(r, [ForwardItem(table, n_ctx, [0] * 3)], q[n_ctx:], kv[n_ctx:])
    assert out.dtype == torch.bfloat16
    for i in range(3):                  # fp32 attention at any length: only the output is rounded (num_seen 0)
        assert_close(out[i], reference(q[n_ctx + i], kv, torch.arange(n_ctx + i + 1)), torch.bfloat16, 0)


native = pytest.mark.skipif(attend_row_library() is None, reason="the native one-row kernel needs AVX-512 and a C "
                            "compiler (or SPECSERVE_NATIVE_KERNELS=0 is set)")


@native
@pytest.mark.parametrize("hkv, g, d", [(3, 3, 64), (2, 4, 128), (1, 1, 32), (4, 8, 64), (2, 9, 64)])
def test_native_row_kernel_matches_float64_and_its_bits_do_not_depend_on_threads(hkv, g, d, two_threads):
    """Every tail of its 16-slot blocks and 256-slot chunks, on strided views of a larger cache (as read in
    place); the same bits at 1 and 2 threads, on a contiguous copy and read through scattered slot numbers."""
    gen = torch.Generator().manual_seed(hkv * 100 + g)
    threads = torch.get_num_threads()
    for t in (1, 15, 16, 17, 255, 257, 1000):
        cache = torch.randn(2, hkv, t + 9, d, generator=gen).bfloat16()
        keys, values = cache[0, :, 4:4 + t], cache[1, :, 4:4 + t]
        query = (3 * torch.randn(hkv, g, d, generator=gen)).bfloat16()
        out = attend_row_native(query, keys, values)
        scores = query.double() @ keys.double().transpose(1, 2) / d ** 0.5
        ref = scores.softmax(-1) @ values.double()
        assert (out.double() - ref).abs().max() <= 5e-3 * ref.abs().max()
        try:
            torch.set_num_threads(1)
            assert torch.equal(attend_row_native(query, keys.contiguous(), values.contiguous()), out)
        finally:
            torch.set_num_threads(threads)
        slots = torch.randperm(2 * t + 5, generator=gen)[:t]             # a paged context, read where it lies
        paged = torch.zeros(2, hkv, 2 * t + 5, d, dtype=torch.bfloat16)
        paged[:, :, slots] = cache[:, :, 4:4 + t]
        assert torch.equal(attend_row_native(query, paged[0], paged[1], slots), out)


@native
def test_attend_one_row_falls_back_to_torch_without_the_native_kernel(monkeypatch):
    query, keys, values = torch.randn(3, 3, 64).bfloat16(), torch.randn(3, 900, 64).bfloat16(), \
        torch.randn(3, 900, 64).bfloat16()
    native_out = attend_one_row(query, keys, values)
    monkeypatch.setenv("SPECSERVE_NATIVE_KERNELS", "0")
    attend_row_library.cache_clear()
    try:
        assert attend_row_native(query, keys, values) is None
        torch_out = attend_one_row(query, keys, values)            # the bf16 products of oneDNN
    finally:
        attend_row_library.cache_clear()
    assert not torch.equal(native_out, torch_out) and torch.allclose(native_out.float(), torch_out.float(), atol=3e-2)


@native
def test_a_drafters_runner_attends_decode_rows_natively_from_its_first_slot():
    """A drafter's runner (no row_by_row) plans its decode-shaped rows for the native call too, each context from
    its context_from (a run of blocks, and a paged one): rows close to float64 and to the masked batched call it
    replaces (native=False, for a caller that edits the masks), the same cache written by both."""
    q, kv = inputs(700, torch.bfloat16, 5)
    tables, lengths, skips = [list(range(20)), [40, 41, 43, 42, 60, 61]], (300, 70), (1, 37)
    fast, slow = (ModelRunner(None, 1, HKV, D, 160, BLOCK, torch.bfloat16) for _ in range(2))
    assert fast.native_rows
    for r in (fast, slow):
        for table, n in zip(tables, lengths):
            attend(r, [ForwardItem(table, 0, list(range(n)))], q[:n], kv[:n])
    items = [ForwardItem(t, n, [0] * k, context_from=c) for t, n, k, c in zip(tables, lengths, (1, 3), skips)]
    _, _, ctx = fast.prepare(items)
    assert ctx.chains is not None and [int(s[3]) for s in ctx.chains.seqs] == [skips[0], -1]
    rows_q, rows_kv = q[400:404], kv[400:404]
    out = paged_attention(rows_q, rows_kv[:, 0], rows_kv[:, 1], ctx, 0)
    _, _, batched = slow.prepare(items, native=False)
    assert batched.chains is None
    masked = paged_attention(rows_q, rows_kv[:, 0], rows_kv[:, 1], batched, 0)
    assert torch.equal(fast.kv_cache, slow.kv_cache)
    for row, (b, j) in enumerate([(0, 0), (1, 0), (1, 1), (1, 2)]):
        full = torch.cat((kv[:lengths[b]], rows_kv[row - j:row + 1]))
        ref = reference(rows_q[row], full, torch.arange(skips[b], lengths[b] + j + 1))
        assert_close(out[row], ref, torch.bfloat16, lengths[b] + j + 1 - skips[b])
        assert_close(masked[row], ref, torch.bfloat16, lengths[b] + j + 1 - skips[b])


@native
def test_a_forward_of_chains_attends_in_one_native_call_with_the_bits_of_row_by_row():
    """Decode and verify rows of a batch (one context a run of blocks, one paged, one fresh) go to the native
    call that writes and attends a whole layer's rows; its output and the cache it writes equal those of the
    per-row path. A tree or a prompt chunk in the forward keeps the per-row path, as do heads the kernel does not
    take (it reads heads of a multiple of 32)."""
    q, kv = inputs(700, torch.bfloat16, 11)
    tables = [list(range(20)), [40, 41, 43, 42, 60, 61], [90, 91]]
    lengths = (300, 70, 3)
    fast, slow = runner(torch.bfloat16), runner(torch.bfloat16)
    for r in (fast, slow):
        for table, n in zip(tables, lengths):
            attend(r, [ForwardItem(table, 0, list(range(n)))], q[:n], kv[:n])
    items = [ForwardItem(t, n, [0] * k) for t, n, k in zip(tables, lengths, (1, 6, 3))]
    _, _, ctx = fast.prepare(items)
    assert ctx.chains is not None and [s[3] >= 0 for s in ctx.chains.seqs] == [True, False, True]
    rows_q, rows_kv = q[400:410], kv[400:410]
    out = paged_attention(rows_q, rows_kv[:, 0], rows_kv[:, 1], ctx, 0)
    _, _, per_row = slow.prepare(items)
    per_row.chains = None
    assert torch.equal(out, paged_attention(rows_q, rows_kv[:, 0], rows_kv[:, 1], per_row, 0))
    assert torch.equal(fast.kv_cache, slow.kv_cache)
    tree = ForwardItem(tables[0], 301, [0] * 3, tree_mask=torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]]).bool())
    assert fast.prepare([tree])[2].chains is None
    assert fast.prepare([items[0], ForwardItem([100, 101, 102], 0, list(range(40)))])[2].chains is None   # a chunk
    assert not ModelRunner(None, 1, 2, 16, 8, BLOCK, torch.bfloat16, row_by_row=True).native_rows   # heads of 16


def test_int8_quantization_rounds_to_a_scale_per_row():
    x = torch.tensor([[0.5, -1.27, 0.0, 0.254], [0.0, 0.0, 0.0, 0.0]]).bfloat16()
    values, scales = quantize_kv(x)
    assert values.dtype == torch.int8 and values.abs().max() == 127
    assert torch.equal(scales, torch.tensor([x[0].float().abs().max().item() / 127, 1.0]))
    assert torch.equal(values[1], torch.zeros(4, dtype=torch.int8))
    assert (dequantize_kv(values, scales) - x.float()).abs().max() <= scales[0] / 2


@pytest.mark.parametrize("n_ctx", (5, 300, 2000))
def test_int8_cache_rows_are_close_to_float64_over_the_dequantized_cache(n_ctx):
    """Chain and tree rows over an int8 cache (native kernel where the CPU has it, else torch over the
    dequantized context): the output's rounding away from float64 attention over the dequantized K/V, and
    within the quantization's error of attention over the bf16 K/V."""
    q, kv = inputs(n_ctx + 6, torch.bfloat16, n_ctx)
    stored = dequantize_kv(*quantize_kv(kv))
    table = list(range(-(-(n_ctx + 6) // BLOCK)))
    r = runner(torch.bfloat16, kv_kind="int8")
    assert r.kv_cache.dtype == torch.int8
    attend(r, [ForwardItem(table, 0, list(range(n_ctx)))], q[:n_ctx], kv[:n_ctx])
    chain = attend(r, [ForwardItem(table, n_ctx, [0] * 6)], q[n_ctx:], kv[n_ctx:])
    for i in range(6):
        seen = torch.arange(n_ctx + i + 1)
        assert_close(chain[i], reference(q[n_ctx + i], stored, seen), torch.bfloat16, 0)
        ref = reference(q[n_ctx + i], kv, seen)
        assert (chain[i].double() - ref).abs().max() <= 0.05 * ref.abs().max()
    tree = Tree([-1, 0, 0, 1, 2, 3])
    out = attend(r, [ForwardItem(table, n_ctx, [0] * 6, tree_mask=tree.attn_mask)], q[n_ctx:], kv[n_ctx:])
    for i, row in enumerate(tree.attn_mask):
        seen = torch.cat((torch.arange(n_ctx), n_ctx + torch.nonzero(row).view(-1)))
        assert_close(out[i], reference(q[n_ctx + i], stored, seen), torch.bfloat16, 0)


@native
def test_int8_chains_in_one_native_call_write_and_attend_as_the_torch_path(two_threads):
    """The native call quantizes the new K/V itself: the cache and scales it writes equal quantize_kv's, and its
    rows the per-row path's (a run of blocks, a paged context, a fresh one)."""
    q, kv = inputs(700, torch.bfloat16, 12)
    tables = [list(range(20)), [40, 41, 43, 42, 60, 61], [90, 91]]
    lengths = (300, 70, 3)
    fast, slow = runner(torch.bfloat16, kv_kind="int8"), runner(torch.bfloat16, kv_kind="int8")
    for r in (fast, slow):
        for table, n in zip(tables, lengths):
            attend(r, [ForwardItem(table, 0, list(range(n)))], q[:n], kv[:n])
    items = [ForwardItem(t, n, [0] * k) for t, n, k in zip(tables, lengths, (1, 6, 3))]
    _, _, ctx = fast.prepare(items)
    assert ctx.chains is not None
    rows_q, rows_kv = q[400:410], kv[400:410]
    out = paged_attention(rows_q, rows_kv[:, 0], rows_kv[:, 1], ctx, 0)
    _, _, per_row = slow.prepare(items)
    per_row.chains = None
    assert torch.equal(out, paged_attention(rows_q, rows_kv[:, 0], rows_kv[:, 1], per_row, 0))
    assert torch.equal(fast.kv_cache, slow.kv_cache) and torch.equal(fast.kv_scales, slow.kv_scales)
    threads = torch.get_num_threads()
    try:                                  # a row's bits do not depend on the threads
        torch.set_num_threads(1)
        _, _, again = fast.prepare(items)
        assert torch.equal(paged_attention(rows_q, rows_kv[:, 0], rows_kv[:, 1], again, 0), out)
    finally:
        torch.set_num_threads(threads)


@native
@pytest.mark.parametrize("vnni", [True, False])
def test_int8_row_kernel_with_and_without_vnni(vnni, monkeypatch, two_threads):
    """The int8 cache's two native paths (integer dot products with AVX512-VNNI; keys widened to bf16 without
    it, built here with -mno-avx512vnni): close to float64 attention over the dequantized K/V, every 16-slot and
    256-slot tail, read in place or through slots, the same bits at 1 and 2 threads."""
    from specserve.layers import kernels
    if vnni and "avx512_vnni" not in kernels.cpu_flags().split():
        pytest.skip("no AVX512-VNNI on this CPU")
    lib = kernels.attend_row_library() if vnni else kernels.attend_row_library("-mno-avx512vnni")
    monkeypatch.setattr(kernels, "attend_row_library", lambda: lib)
    gen = torch.Generator().manual_seed(5)
    threads = torch.get_num_threads()
    for t in (1, 17, 257, 1000):
        values, scales = quantize_kv(torch.randn(2, HKV, t + 9, D, generator=gen).bfloat16())
        keys, vals, ks, vs = values[0, :, 4:4 + t], values[1, :, 4:4 + t], scales[0, :, 4:4 + t], scales[1, :, 4:4 + t]
        query = (3 * torch.randn(HKV, G, D, generator=gen)).bfloat16()
        out = attend_row_native(query, keys, vals, scales=(ks, vs))
        k, v = dequantize_kv(keys, ks).double(), dequantize_kv(vals, vs).double()
        ref = (query.double() @ k.transpose(1, 2) / D ** 0.5).softmax(-1) @ v
        assert (out.double() - ref).abs().max() <= 5e-3 * ref.abs().max()
        try:
            torch.set_num_threads(1)
            assert torch.equal(attend_row_native(query, keys.contiguous(), vals.contiguous(),
                                                 scales=(ks.contiguous(), vs.contiguous())), out)
        finally:
            torch.set_num_threads(threads)
        slots = torch.randperm(2 * t + 5, generator=gen)[:t]
        paged, paged_scales = torch.zeros(2, HKV, 2 * t + 5, D, dtype=torch.int8), torch.ones(2, HKV, 2 * t + 5)
        paged[:, :, slots], paged_scales[:, :, slots] = values[:, :, 4:4 + t], scales[:, :, 4:4 + t]
        assert torch.equal(attend_row_native(query, paged[0], paged[1], slots, (paged_scales[0], paged_scales[1])), out)
