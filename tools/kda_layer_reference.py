#!/usr/bin/env python3
"""Reference outputs of layer 0's KDA attention of the kimi-linear-tiny and kimi-k3-tiny fixture
models, computed independently from the spec math (docs/spec.md §5.3, §11) in PyTorch float64 with
a token-by-token recurrence, on a fixed random input. Writes tests/data/kda_layer/<model>.safetensors
with x [B, T, D] and y [B, T, D] (float32). Used by src/mixers/linear/delta_layer_test.cc.

    python3 tools/kda_layer_reference.py [--shared ../shared]
"""
import argparse
import os

import torch
from safetensors.torch import load_file, save_file

MODELS = {
    "kimi-linear-tiny": dict(prefix="model.layers.0.self_attn.", k3=False),
    "kimi-k3-tiny": dict(prefix="language_model.model.layers.0.self_attn.", k3=True),
}
H, K, EPS = 4, 32, 1e-5


def short_conv_silu(x, w):  # x [B, T, C], w [C, 1, W]: causal depthwise conv, zero left padding, then SiLU
    W = w.shape[-1]
    xp = torch.nn.functional.pad(x, (0, 0, W - 1, 0))
    y = sum(xp[:, i:i + x.shape[1], :] * w[:, 0, i] for i in range(W))
    return torch.nn.functional.silu(y)


def l2norm(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def layer(p, x, k3):
    B, T, _ = x.shape
    lin = lambda name, t: t @ p[name + ".weight"].T
    q = l2norm(short_conv_silu(lin("q_proj", x), p["q_conv1d.weight"]).view(B, T, H, K))
    k = l2norm(short_conv_silu(lin("k_proj", x), p["k_conv1d.weight"]).view(B, T, H, K))
    v = short_conv_silu(lin("v_proj", x), p["v_conv1d.weight"]).view(B, T, H, K)
    f = lin("f_b_proj", lin("f_a_proj", x)).view(B, T, H, K) + p["dt_bias"].view(H, K)
    a = torch.exp(p["A_log"].reshape(-1)[:H]).view(H, 1)  # per head: fla's kernel reads A_log[h]
    g = -5.0 * torch.sigmoid(a * f) if k3 else -a * torch.nn.functional.softplus(f)
    beta = torch.sigmoid(lin("b_proj", x))  # [B, T, H]
    scale = K ** -0.5
    S = torch.zeros(B, H, K, K, dtype=x.dtype)
    o = torch.zeros(B, T, H, K, dtype=x.dtype)
    for t in range(T):  # decay, delta write, read (spec §5.1)
        S = S * torch.exp(g[:, t])[..., None]
        kt = k[:, t]
        u = beta[:, t][..., None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, kt))
        S = S + kt[..., None] * u[..., None, :]
        o[:, t] = torch.einsum("bhkv,bhk->bhv", S, scale * q[:, t])
    gate = lin("g_proj", x) if k3 else lin("g_b_proj", lin("g_a_proj", x))
    gate = gate.view(B, T, H, K)
    on = o / torch.sqrt((o * o).mean(-1, keepdim=True) + EPS) * p["o_norm.weight"] * torch.sigmoid(gate)
    return lin("o_proj", on.reshape(B, T, H * K))


def main():
    ap = argparse.ArgumentParser()
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--shared", default=os.path.join(here, "..", "..", "shared"))
    ap.add_argument("--out", default=os.path.join(here, "..", "tests", "data", "kda_layer"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for name, m in MODELS.items():
        sd = load_file(os.path.join(args.shared, "fixtures", "models", name, "model.safetensors"))
        p = {k[len(m["prefix"]):]: v.double() for k, v in sd.items() if k.startswith(m["prefix"])}
        gen = torch.Generator().manual_seed(1234)
        x = torch.randn(2, 37, 128, generator=gen, dtype=torch.float64)
        y = layer(p, x, m["k3"])
        save_file({"x": x.float().contiguous(), "y": y.float().contiguous()}, os.path.join(args.out, name + ".safetensors"),
                  metadata={"what": f"{name} layer-0 KDA attention, float64 recurrence", "tool": "tools/kda_layer_reference.py"})
        print(name, "y rms", y.pow(2).mean().sqrt().item())


if __name__ == "__main__":
    main()
