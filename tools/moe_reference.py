#!/usr/bin/env python3
"""Reference outputs of one MoE layer (layer 1) of each fixture model, for src/ffn/moe_fixture_test.cc.

Written from the math of docs/spec.md §8.1 (noaux_tc routing), §8.2 (K3 Stable LatentMoE) and §9
(SiTU), independently of the C++ code, in float64 (the router's scores in float32, as the spec
says, so the selection sees the same numbers as an fp32 implementation). The combine weights
are the UNBIASED scores for all three models: the kimi-linear-tiny fixture was produced by
transformers' KimiLinearMoE, which gathers unbiased scores (checked: the whole-model logits match
the fixture at 9.6e-6 relative L2 with unbiased weights and miss by 0.17 with biased ones).

Writes tests/data/moe/<model>_layer1.safetensors with x [T, D], y [T, D], topk_idx [T, K] (int64,
sorted ascending per token) and topk_weight [T, K] (in the same order). With --check-transformers
it also runs transformers' own DeepseekV3MoE / KimiLinearMoE on x and compares.

Usage: python3 tools/moe_reference.py [--shared ../shared] [--check-transformers]
"""
import argparse
import json
import os

import torch
from safetensors.torch import load_file, save_file

T = 16  # tokens

MODELS = {
    "deepseek-v3-tiny": dict(prefix="model.layers.1.mlp.", gate="gate_proj", up="up_proj", down="down_proj",
                             act="silu", latent=False),
    "kimi-linear-tiny": dict(prefix="model.layers.1.block_sparse_moe.", gate="w1", up="w3", down="w2",
                             act="silu", latent=False),
    "kimi-k3-tiny": dict(prefix="language_model.model.layers.1.block_sparse_moe.", gate="w1", up="w3", down="w2",
                         act="situ", latent=True),
}


def text_config(cfg):
    return cfg.get("text_config", cfg)


def routing_params(c):
    return dict(
        E=c.get("n_routed_experts", c.get("num_experts")),
        K=c.get("num_experts_per_tok", c.get("num_experts_per_token")),
        n_group=c.get("n_group", c.get("num_expert_group", 1)),
        topk_group=c.get("topk_group", 1),
        renorm=c.get("norm_topk_prob", c.get("moe_renormalize", True)),
        scale=c["routed_scaling_factor"],
        n_shared=c.get("n_shared_experts", c.get("num_shared_experts", 0)),
    )


def act_fn(kind, c):
    if kind == "silu":
        return lambda g, u: torch.nn.functional.silu(g) * u
    beta, beta_lin = c.get("activation_situ_beta"), c.get("activation_situ_linear_beta")

    def situ(g, u):  # spec §9
        a = beta * torch.tanh(g / beta) * torch.sigmoid(g) if beta is not None else torch.nn.functional.silu(g)
        b = beta_lin * torch.tanh(u / beta_lin) if beta_lin is not None else u
        return a * b
    return situ


def glu(x, W, pre, names, act):
    g = x @ W[pre + names["gate"] + ".weight"].T
    u = x @ W[pre + names["up"] + ".weight"].T
    return act(g, u) @ W[pre + names["down"] + ".weight"].T


def route(x32, W, pre, p):
    """Spec §8.1 steps 1-8. Returns (idx [T,K], weights [T,K] float64, choice margin)."""
    logits = x32 @ W[pre + "gate.weight"].float().T  # fp32 router
    s = torch.sigmoid(logits)
    choice = s + W[pre + "gate.e_score_correction_bias"].float()
    E, G = p["E"], p["n_group"]
    if G > 1:
        grp = choice.view(-1, G, E // G).topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(grp).scatter_(1, grp.topk(p["topk_group"], dim=-1).indices, 1.0)
        mask = keep.unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E).bool()
        choice = choice.masked_fill(~mask, float("-inf"))
    top = choice.topk(p["K"] + 1, dim=-1)
    margin = (top.values[:, p["K"] - 1] - top.values[:, p["K"]]).min().item()
    idx = top.indices[:, : p["K"]].sort(dim=-1).values
    w = s.double().gather(1, idx)  # UNBIASED scores (step 6)
    if p["renorm"]:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return idx, w * p["scale"], margin


def moe_layer(x, W, spec, c):
    pre = spec["prefix"]
    p = routing_params(c)
    act = act_fn(spec["act"], c)
    names = dict(gate=spec["gate"], up=spec["up"], down=spec["down"])
    W64 = {k: v.double() for k, v in W.items() if k.startswith(pre)}
    W64.update({k: W[k] for k in (pre + "gate.weight", pre + "gate.e_score_correction_bias")})
    idx, w, margin = route(x.float(), W64, pre, p)
    xr = x @ W64[pre + "routed_expert_down_proj.weight"].T if spec["latent"] else x  # spec §8.2 step 2
    r = torch.zeros(x.shape[0], xr.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(p["K"]):
            e = int(idx[t, k])
            r[t] += w[t, k] * glu(xr[t:t + 1], W64, f"{pre}experts.{e}.", names, act)[0]
    if spec["latent"]:
        if c.get("latent_moe_use_norm"):  # RMSNorm, eps = rms_norm_eps (spec §0, §8.2 step 4)
            r = r / torch.sqrt((r * r).mean(-1, keepdim=True) + c["rms_norm_eps"])
            r = r * W64[pre + "routed_expert_norm.weight"]
        r = r @ W64[pre + "routed_expert_up_proj.weight"].T
    shared = dict(gate="gate_proj", up="up_proj", down="down_proj")
    y = r + glu(x, W64, pre + "shared_experts.", shared, act) if p["n_shared"] else r
    return y, idx, w, margin


def check_transformers(model_dir, x, y):
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = m.model.layers[1].mlp(x.float().unsqueeze(0))
    out = out[0] if isinstance(out, tuple) else out
    return (out.squeeze(0).double() - y).norm().item() / y.norm().item()


def main():
    ap = argparse.ArgumentParser()
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--shared", default=os.path.join(here, "..", "..", "shared"))
    ap.add_argument("--out", default=os.path.join(here, "..", "tests", "data", "moe"))
    ap.add_argument("--check-transformers", action="store_true")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    for i, (name, spec) in enumerate(MODELS.items()):
        d = os.path.join(a.shared, "fixtures", "models", name)
        c = text_config(json.load(open(os.path.join(d, "config.json"))))
        W = load_file(os.path.join(d, "model.safetensors"))
        gen = torch.Generator().manual_seed(1234 + i)
        x = torch.randn(T, c["hidden_size"], generator=gen, dtype=torch.float32).double()
        y, idx, w, margin = moe_layer(x, W, spec, c)
        # The selection must not hinge on fp32 rounding: the K-th and (K+1)-th choice scores differ.
        assert margin > 1e-4, f"{name}: top-k margin {margin} too small, pick another seed"
        meta = {"fixture": json.dumps({"model": name, "layer": 1, "prefix": spec["prefix"], "tokens": T,
                                       "combine": "unbiased", "formula": "spec §8.1/§8.2/§9, float64"})}
        save_file({"x": x.float().contiguous(), "y": y.float().contiguous(), "topk_idx": idx.long().contiguous(),
                   "topk_weight": w.float().contiguous()}, os.path.join(a.out, f"{name}_layer1.safetensors"), meta)
        msg = f"{name}: |y| {y.norm():.4g}, top-k margin {margin:.3g}"
        if a.check_transformers and name != "kimi-k3-tiny":  # K3 has no transformers module (oracles.md)
            msg += f", transformers rel L2 {check_transformers(d, x, y):.3g}"
        print(msg)


if __name__ == "__main__":
    main()
