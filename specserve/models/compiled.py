"""`--compile`: the target's paged forward as torch.compile graphs (inductor, its C++ wrapper), on CPU.

Why: at batch 1 a SmolLM2-135M step makes ~3,100 torch calls (about 100 a layer: norms, rotary, views,
residuals), ~1.3 us each, which is 40% of an int4 step (benchmarks/NOTES.md, "Session 11"). Inductor fuses a
layer's elementwise work into a few C++ loops, and its C++ wrapper calls them and the products with no Python
in between.

What a graph holds: the embedding, every layer's norms, rotary and residuals, and the products inductor can
call itself (the int8 / int4 weight-only aten ops). Two things stay opaque, each one custom op that runs its
Python eagerly:
- attention (`specserve::paged_attention`): it writes the cache and walks the step's plan (ForwardContext,
  Python data), so the op reads the context of the forward in progress from this module, as vLLM's unified
  attention op does;
- every product inductor cannot call (oneDNN's packed weights, a bucketed InferenceLinear): `specserve::linear`
  runs the kernel chosen at load, so a row's bits are those the kernel chooser checked (layers/linear.py).

Exactness: decode, verify and prompt forwards all run compiled code: one graph for one row, one with the rows
dynamic; a row's elementwise work does not depend on the rows beside it, and the products are the eager
kernels. So greedy speculative output equals greedy plain output under compile (tests/test_compiled.py).
Compiled output is not bit-identical to eager output (inductor sums a norm in its own order): the flag may
change a near tie, as a dtype does.

Guards: dynamo would check every weight on every call (~0.8 ms a step); the graphs depend only on their
inputs, so only the inputs' guards are kept. Each model (and each set of aux layers it returns) gets its own code
object, so that two engines in one process never share a graph (dynamo keeps graphs per code object).
"""
from __future__ import annotations

import functools
import itertools
import os
import types
from dataclasses import replace

import torch
from torch import nn

from specserve.layers.attention import ForwardContext, paged_attention
from specserve.models.llama import LayerWeights, decoder_layer, frozen_linear, rms_norm

# inductor's settings for these graphs: the C++ wrapper (the Python one costs ~60 us a layer), bf16 rounded
# where eager rounds it, and single-threaded loops (a decode row's few thousand elements do not pay a fork)
OPTIONS = {"cpp_wrapper": True, "emulate_precision_casts": True, "cpp.threads": 1}
INPUTS = ("input_ids", "positions")

_forward: list[ForwardContext | None] = [None]          # the context of the compiled forward in progress
_kernels: dict[int, nn.Module] = {}                     # specserve::linear's kernels, by number
_kernel_numbers = itertools.count()
_code_numbers = itertools.count()

_lib = torch.library.Library("specserve", "DEF")
_lib.define("paged_attention(Tensor q, Tensor k, Tensor v, int layer) -> Tensor")
_lib.define("linear(Tensor x, int kernel, int out_features) -> Tensor")
_lib.impl("paged_attention", lambda q, k, v, layer: paged_attention(q, k, v, _forward[0], layer).contiguous(), "CPU")
_lib.impl("paged_attention", lambda q, k, v, layer: q.new_empty(q.shape), "Meta")
_lib.impl("linear", lambda x, kernel, out_features: _kernels[kernel](x), "CPU")
_lib.impl("linear", lambda x, kernel, out_features: x.new_empty(*x.shape[:-1], out_features), "Meta")


class OpaqueAttention:
    """What the compiled layers are given as their ForwardContext: attention through the opaque op."""

    @staticmethod
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        return torch.ops.specserve.paged_attention(q, k, v, layer)


def traceable(kernel) -> bool:
    """An aten op over fixed weights (the int8 / int4 kernels): inductor calls it itself."""
    return isinstance(kernel, functools.partial) and isinstance(kernel.func, (torch._ops.OpOverloadPacket,
                                                                              torch._ops.OpOverload))


def graph_linear(module: nn.Module):
    kernel = frozen_linear(module)
    if traceable(kernel):
        return kernel
    number = next(_kernel_numbers)
    _kernels[number] = module
    return functools.partial(torch.ops.specserve.linear, kernel=number, out_features=module.out_features)


def graph_weights(layer: nn.Module) -> LayerWeights:
    """The layer's frozen bundle with each product as the graph calls it."""
    w, attn, mlp = layer.frozen, layer.self_attn, layer.mlp
    return replace(w, attn=replace(w.attn, qkv=graph_linear(attn.qkv_proj), o=graph_linear(attn.o_proj), norm=rms_norm),
                   gate_up=graph_linear(mlp.gate_up_proj), down=graph_linear(mlp.down_proj), norm=rms_norm)


def own_code(fn: types.FunctionType) -> types.FunctionType:
    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}_{next(_code_numbers)}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


def input_guards(entries) -> list[bool]:
    """Keep the guards on the inputs (shapes, dtypes) and on torch's global state; drop those on
    the weights and modules the graph was traced with, which never change."""
    return [e.name in INPUTS or e.name == "" for e in entries]


def key_inductor_cache_by_isa() -> None:
    """inductor's on-disk cache does not key its C++ kernels by the vector ISA they were written for: kernels cached
    on an AVX-512 CPU and built again where inductor targets AVX2 (another CPU sharing the folder, or
    ATEN_CPU_CAPABILITY=avx2) step 16 lanes over 8-lane vectors, leave half of each output unwritten and return NaN
    (session 22). Unless the user chose a folder, each ISA gets its own."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    default, chosen = os.path.abspath(default_cache_dir()), os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen is None or os.path.abspath(chosen) == default:      # inductor's default, not the user's
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{default}_{'_'.join(str(pick_vec_isa()).split()) or 'novec'}"


class CompiledForward:
    """model.run_layers over the paged cache, compiled; called as the model's forward is."""

    def __init__(self, model: nn.Module):
        if not model.model.embed_tokens.weight.is_cpu or any(layer.frozen is None for layer in model.model.layers):
            raise ValueError("--compile: only a model packed for inference on CPU is compiled (--device cpu)")
        key_inductor_cache_by_isa()
        self.model = model
        self.layers = [lambda x, cos, sin, ctx, w=graph_weights(layer): decoder_layer(x, w, cos, sin, ctx)
                       for layer in model.model.layers]
        self.graphs: dict[tuple[int, ...], types.FunctionType] = {}   # per aux_layers (EAGLE3 reads some)
        self.compiled_once = False

    def graph(self, aux_layers: tuple[int, ...]):
        if aux_layers not in self.graphs:
            # a frozenset: with dynamic=True dynamo makes a closure's tuple of ints symbolic, and `i in` that
            # tuple then traced as False (torch 2.13): the graph returned no aux states and EAGLE3 failed
            model, layers, stand_in, aux = self.model, self.layers, OpaqueAttention(), frozenset(aux_layers)

            def forward(input_ids, positions):
                return model.run_layers(input_ids, positions, stand_in, aux, layers)
            self.graphs[aux_layers] = torch.compile(own_code(forward), dynamic=True, fullgraph=True,
                                                    options={**OPTIONS, "guard_filter_fn": input_guards})
        return self.graphs[aux_layers]

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                 aux_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        _forward[0] = ctx
        try:
            out = self.graph(tuple(aux_layers))(input_ids, positions)
        except Exception as e:
            if self.compiled_once:
                raise
            raise RuntimeError(f"--compile: torch.compile could not compile the model ({type(e).__name__}: "
                               f"{str(e)[:500]}); run without --compile") from e
        finally:
            _forward[0] = None
        self.compiled_once = True
        return out
