#!/usr/bin/env python3
"""Reference for k3's training step: three AdamW steps of the fixture models in PyTorch.

For gpt2-tiny and kimi-linear-tiny (../shared/fixtures/models) this loads the model with
transformers, runs 3 steps of next-token cross-entropy on a fixed batch with
torch.optim.AdamW (lr 1e-3, betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on 2-D weight
matrices only; norms, biases and embeddings undecayed), clipping the global gradient norm at
1.0, and writes tests/data/train/<model>_adamw.safetensors with the batch, the three losses and
every parameter after the third step (by HF name).

    python3 tools/make_train_goldens.py [--shared ../shared]
"""
import argparse
import json
import os

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))


def decays(name, p):
    lname = name.lower()
    if p.ndim != 2:
        return False
    return not any(s in lname for s in ("embed", "wte", "wpe", "norm", "res_proj"))


def run(shared, model_name):
    folder = os.path.join(shared, "fixtures", "models", model_name)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    model.train()
    expected = load_file(os.path.join(folder, "expected.safetensors"))
    batch = expected["input_ids"][:, :33].clone()  # [2, 33]: 32 inputs + their targets
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for n, p in named if decays(n, p)]
    no_decay = [p for n, p in named if not decays(n, p)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    losses = []
    grads0 = {}
    for step in range(3):
        opt.zero_grad()
        logits = model(batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))
        loss.backward()
        if step == 0:  # the first step's gradients, before clipping
            grads0 = {n: p.grad.detach().float().clone() for n, p in named if p.grad is not None}
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    out = {"batch": batch.to(torch.int64), "losses": torch.tensor(losses, dtype=torch.float32)}
    for n, g in grads0.items():
        out["grad0." + n] = g.contiguous()
    seen = set()
    for n, p in model.named_parameters():  # tied parameters appear once
        if id(p) in seen:
            continue
        seen.add(id(p))
        out["param." + n] = p.detach().float().clone().contiguous()
    meta = {"fixture": json.dumps({"model": model_name, "steps": 3, "lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                   "weight_decay": 0.1, "decay": "2-D weights except embeddings and norms",
                                   "clip": 1.0, "torch": torch.__version__})}
    path = os.path.join(HERE, "..", "tests", "data", "train", model_name + "_adamw.safetensors")
    save_file(out, path, metadata=meta)
    print(model_name, "losses", losses, "->", os.path.normpath(path))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shared", default=os.path.join(HERE, "..", "..", "shared"))
    a = ap.parse_args()
    for m in ("gpt2-tiny", "kimi-linear-tiny"):
        run(a.shared, m)


if __name__ == "__main__":
    main()
