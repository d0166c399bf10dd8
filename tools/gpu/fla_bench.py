#!/usr/bin/env python3
"""Times flash-linear-attention's kernels on the shapes `k3 bench kernels` times, in the same
session on the same GPU, and writes {key: milliseconds} JSON for `k3 bench kernels --versus`.
fla is installed from its PyPI wheels (flash-linear-attention, fla-core) beside k3, not vendored.
Usage: fla_bench.py OUT.json [--seq-len 8192 32768] [--heads 16] [--decode-batch 64 256] [--varlen] [--no-sdpa]"""
import argparse
import itertools
import json
import sys
import time

import torch
import triton

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--seq-len", type=int, nargs="+", default=[8192, 32768])
p.add_argument("--kinds", nargs="*", default=["kda", "deltanet"],
               help="gdn needs Triton >= 3.7.1 or tilelang on Hopper (fla refuses Triton 3.4-3.7.0)")
p.add_argument("--heads", type=int, nargs="+", default=[16])
p.add_argument("--decode-batch", type=int, nargs="+", default=[64, 256])
p.add_argument("--no-backward", action="store_true", help="skip fwd+bwd (its first-call autotune takes minutes)")
p.add_argument("--varlen", action="store_true",
               help="also a packed batch (cu_seqlens) of 16 sequences of 64..1024 tokens, H 16, as `bench kernels --only varlen`")
p.add_argument("--no-sdpa", action="store_true", help="skip PyTorch's SDPA figures")
args = p.parse_args()

if args.kinds:  # `--kinds` with no kind times PyTorch's figures alone (no fla needed)
    from fla.ops.delta_rule import chunk_delta_rule, fused_recurrent_delta_rule  # noqa: E402
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule  # noqa: E402
    from fla.ops.kda import chunk_kda, fused_recurrent_kda  # noqa: E402

dev, bf = "cuda", torch.bfloat16
K = V = 128
res = {}
t_start = time.time()


def ms(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def record(key, value):
    # Written after every figure, so a run stopped by a time limit keeps what it measured.
    res[key] = value
    json.dump(res, open(args.out, "w"), indent=2)
    print(f"{time.time() - t_start:6.1f}s {key:32s} {value:.4f}", flush=True)


def inputs(B, T, H, kind):
    q = torch.randn(B, T, H, K, device=dev, dtype=bf)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device=dev, dtype=torch.float32), dim=-1).to(bf)
    v = torch.randn(B, T, H, V, device=dev, dtype=bf)
    beta = torch.rand(B, T, H, device=dev, dtype=bf)
    if kind == "kda":
        g = -5 * torch.rand(B, T, H, K, device=dev, dtype=torch.float32)
    elif kind == "gdn":
        g = -5 * torch.rand(B, T, H, device=dev, dtype=torch.float32)
    else:
        g = None
    return q, k, v, beta, g


def chunk(kind, q, k, v, beta, g, **kw):
    if kind == "kda":
        return chunk_kda(q, k, v, g, beta, **kw)
    if kind == "gdn":
        return chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    return chunk_delta_rule(q, k, v, beta, **kw)


def recurrent(kind, q, k, v, beta, g, h0):
    if kind == "kda":
        return fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    if kind == "gdn":
        return fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    return fused_recurrent_delta_rule(q, k, v, beta, initial_state=h0, output_final_state=True)


# PyTorch's own device copy, for comparison with k3's measured ceiling.
a = torch.empty(2 << 30, dtype=torch.uint8, device=dev)
b = torch.empty_like(a)
record("torch_copy_GBps", 2 * a.numel() / (ms(lambda: b.copy_(a)) * 1e-3) / 1e9)
del a, b

# PyTorch's SDPA on k3's causal prefill shapes, each backend timed on its own (cuDNN, flash,
# memory-efficient); the key without a backend holds the fastest. hd 192 / hdv 128 is MLA's
# prefill (the flash backend needs hd = hdv), hd 64 GPT-2's.
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

SDPA_BACKENDS = (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                 ("efficient", SDPBackend.EFFICIENT_ATTENTION))


def time_backends(what, fn):
    """Records fn's time under each SDPA backend as sdpa_{backend}_{what}, the fastest as sdpa_{what}."""
    best = None
    for name, backend in SDPA_BACKENDS:
        try:
            with sdpa_kernel(backend):
                t = ms(fn)
        except Exception as e:  # a backend that does not take the shape
            print(f"sdpa {name} {what}: {type(e).__name__}: {str(e)[:120]}", file=sys.stderr)
            continue
        record(f"sdpa_{name}_{what}", t)
        best = t if best is None else min(best, t)
    if best is not None:
        record(f"sdpa_{what}", best)


for T in ([] if args.no_sdpa else args.seq_len):
    for hd, hdv, suffix in ((128, 128, ""), (192, 128, "_hd192"), (64, 64, "_hd64")):
        q = torch.randn(1, 16, T, hd, device=dev, dtype=bf)
        k_ = torch.randn_like(q)
        v_ = torch.randn(1, 16, T, hdv, device=dev, dtype=bf)
        time_backends(f"fwd_T{T}_H16{suffix}",
                      lambda: torch.nn.functional.scaled_dot_product_attention(q, k_, v_, is_causal=True))
        if hd != hdv:
            continue
        # Forward + backward (the gradients of q, k and v).
        dout = torch.randn_like(v_)
        for t_ in (q, k_, v_):
            t_.requires_grad_(True)
        time_backends(f"fwdbwd_T{T}_H16{suffix}", lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k_, v_, is_causal=True).backward(dout))

# GPT-2 124M's training shape: B 8, T 1024, 12 heads of 64.
if not args.no_sdpa:
    q = torch.randn(8, 12, 1024, 64, device=dev, dtype=bf)
    k_ = torch.randn_like(q)
    v_ = torch.randn_like(q)
    time_backends("fwd_gpt2", lambda: torch.nn.functional.scaled_dot_product_attention(q, k_, v_, is_causal=True))
    dout = torch.randn_like(v_)
    for t_ in (q, k_, v_):
        t_.requires_grad_(True)
    time_backends("fwdbwd_gpt2", lambda: torch.nn.functional.scaled_dot_product_attention(
        q, k_, v_, is_causal=True).backward(dout))

# The packed batch of `bench kernels --only varlen`: lengths 64·(1 + 7i mod 16), i < 16.
VARLEN = [64 * (1 + (7 * i) % 16) for i in range(16)]

for kind in args.kinds:
    for H in args.heads:
        for T in args.seq_len:
            key = f"{kind}_fwd_T{T}_H{H}"
            try:
                q, k, v, beta, g = inputs(1, T, H, kind)
                record(key, ms(lambda: chunk(kind, q, k, v, beta, g)))
                if T == args.seq_len[0] and not args.no_backward:
                    tensors = [q, k, v, beta] + ([g] if g is not None else [])
                    for t in tensors:
                        t.requires_grad_(True)
                    do = torch.randn_like(v)

                    def fb():
                        o = chunk(kind, q, k, v, beta, g)[0]
                        o.backward(do)

                    record(f"{kind}_fwdbwd_T{T}_H{H}", ms(fb))
            except Exception as e:  # report, keep going
                print(f"{key}: {type(e).__name__}: {e}", file=sys.stderr)
    if args.varlen:
        key = f"{kind}_varlen_fwd_H16"
        try:
            q, k, v, beta, g = inputs(1, sum(VARLEN), 16, kind)
            cu = torch.tensor([0] + list(itertools.accumulate(VARLEN)), device=dev, dtype=torch.long)
            record(key, ms(lambda: chunk(kind, q, k, v, beta, g, cu_seqlens=cu)))
            if not args.no_backward:
                for t in [q, k, v, beta] + ([g] if g is not None else []):
                    t.requires_grad_(True)
                do = torch.randn_like(v)
                record(f"{kind}_varlen_fwdbwd_H16", ms(lambda: chunk(kind, q, k, v, beta, g, cu_seqlens=cu)[0].backward(do)))
        except Exception as e:
            print(f"{key}: {type(e).__name__}: {e}", file=sys.stderr)
    for N in args.decode_batch:
        key = f"{kind}_decode_N{N}_ms"
        try:
            H = 16
            q, k, v, beta, g = inputs(N, 1, H, kind)
            h0 = torch.randn(N, H, K, V, device=dev, dtype=torch.float32) * 0.1
            record(key, ms(lambda: recurrent(kind, q, k, v, beta, g, h0)))
        except Exception as e:
            print(f"{key}: {type(e).__name__}: {e}", file=sys.stderr)


