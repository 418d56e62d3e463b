"""The Triton kernels compile for an H100 (sm_90) without a GPU: Triton's own compiler and
the ptxas bundled with it, in a subprocess (the other Triton tests switch this process to
the interpreter). Catches what the interpreter lets through: dot shapes, types, early returns."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

SCRIPT = r'''
import sys
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from refinery.kernels import triton_attention as ta, triton_moe as tm

target = GPUTarget("cuda", 90, 32)


def build(fn, sig, consts):
    full = {name: ("constexpr" if name in consts else sig[name]) for name in fn.arg_names}
    kernel = triton.compile(ASTSource(fn, full, constexprs=consts), target=target)
    assert kernel.asm["cubin"], fn.__name__
    print(fn.__name__, "shared", kernel.metadata.shared)


dt, DT = "bf16", tl.bfloat16
build(tm._route_kernel, dict(logits_ptr="*bf16", idx_ptr="*i64", weight_ptr="*bf16", E="i32", stride_n="i32"),
      dict(TOPK=4, BLOCK_E=32, BLOCK_K=4))
moe = dict(rows_ptr="*i64", block_expert_ptr="*i64", blocks_ptr="*u8", scales_ptr="*u8", bias_ptr="*bf16",
           n_rows="i32", H="i32", I="i32")
build(tm._mlp1_kernel, dict(moe, x_ptr="*bf16", act_ptr="*bf16", stride_x="i32", limit="fp32", alpha="fp32"),
      dict(TOPK=4, BLOCK_M=16, BLOCK_N=64, BLOCK_KB=64, PRECISION="tf32", DOT=DT))
build(tm._mlp2_kernel, dict(moe, act_ptr="*bf16", gate_w_ptr="*bf16", out_ptr="*fp32"),
      dict(BLOCK_M=64, BLOCK_N=64, BLOCK_KB=64, PRECISION="tf32", DOT=DT))
i32 = "i32"
build(ta._attention_kernel,
      dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", sinks_ptr="*fp32", q_pos_ptr="*i64", k_pos_ptr="*i64",
           lo_ptr="*i64", hi_ptr="*i64", o_ptr="*bf16", n_q=i32, sq_n=i32, sq_h=i32, sk_n=i32, sk_h=i32,
           sv_n=i32, sv_h=i32, so_n=i32, so_h=i32, qk_scale="fp32", window=i32),
      dict(GROUP=8, HEAD_DIM=64, BLOCK_D=64, BLOCK_M=64, BLOCK_N=64, HAS_WINDOW=True, PRECISION="tf32", DOT=DT))
build(ta._paged_attention_kernel,
      dict(q_ptr="*bf16", k_pool_ptr="*bf16", v_pool_ptr="*bf16", sinks_ptr="*fp32", table_ptr="*i64",
           query_start_ptr="*i64", seq_lens_ptr="*i64", tile_seq_ptr="*i64", tile_q0_ptr="*i64", o_ptr="*bf16",
           sq_n=i32, sq_h=i32, so_n=i32, so_h=i32, s_table=i32, s_block=i32, s_page=i32, s_head=i32,
           qk_scale="fp32", window=i32),
      dict(GROUP=8, GROUP_P=8, HEAD_DIM=64, BLOCK_D=64, BLOCK_Q=2, BLOCK_N=64, PAGE=16, HAS_WINDOW=True,
           PRECISION="tf32", DOT=DT))
'''


def test_kernels_compile_for_sm90(tmp_path):
    ptxas = Path(importlib.util.find_spec("triton").origin).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("this triton build has no bundled ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path / "cache"), TRITON_DEFAULT_FP_FUSION="1")
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    built = [line.split()[0] for line in done.stdout.splitlines()]
    assert built == ["_route_kernel", "_mlp1_kernel", "_mlp2_kernel", "_attention_kernel", "_paged_attention_kernel"]
