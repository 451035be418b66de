"""The kernels as torch ops: `torch.ops.edge_w4.linear`, defined by the C++ library
(`TORCH_LIBRARY(edge_w4, ...)` in csrc/edge_w4.cpp), with the fake (meta) implementation
torch.compile needs to trace a model through it without running it.

    linear(x [M, K], q, s, z?, group, layout, isa, small_m_max, tile) -> [M, N], x's dtype

N is q.shape[0]; `layout` 1 (lanes64) or 2 (words128) is the w4a16 scheme, 0 (blocks32),
3 (nib128), 4 (lanes1k) or 5
(stripes16) w4a8.
"""

from __future__ import annotations

import functools

import torch

from edge_infer.kernels import ext


@functools.cache
def load() -> None:
    """Load the library (which defines the op) once, and register its fake implementation."""
    ext.load()

    @torch.library.register_fake("edge_w4::linear")
    def _(x, q, s, z, group, layout, isa, small_m_max, tile):
        return x.new_empty((x.shape[0], q.shape[0]))

    # the fused decoder-layer ops (csrc/edge_layer.cpp; used by edge_infer.vllm_ext.fused)
    @torch.library.register_fake("edge_w4::attn_in")
    def _(residual, x, ln, eps, wq, ws, wz, meta, q_norm, k_norm, head_eps, cos_sin, positions,
          nq, nkv, d, rot, gate_w, qkv_bias):
        m = residual.shape[0]
        gates = residual.new_empty((m, nq) if gate_w is not None else (0,))
        return residual.new_empty((m, (nq + 2 * nkv) * d)), gates

    # edge_w4::decode_step (every layer of a decode step, over an edge_w4.DecodeStack) has no
    # fake: the fused path calls it eagerly, outside any compiled graph

    @torch.library.register_fake("edge_w4::mlp_out")
    def _(residual, attn, oq, os, oz, ometa, ln, eps, gq, gs, gz, gmeta, dq, ds, dz, dmeta, act,
          head_gate):
        return residual.new_empty(residual.shape)
