#!/usr/bin/env python3
"""Reference for k3's block-scaled FP8 weights (DeepSeek-V3 / Kimi checkpoints: F8_E4M3 weights
with a float32 `weight_scale_inv` per 128 x 128 block).

Quantizes every projection weight of ../shared/fixtures/models/deepseek-v3-tiny (attention and MLP
projections, the experts; not the embeddings, norms, router or head, as DeepSeek-V3 ships them)
to torch.float8_e4m3fn with one scale per 128 x 128 block (amax / 448, the ragged edge blocks
included), writes that checkpoint with the config's quantization_config, and computes the logits
of transformers' DeepseekV3ForCausalLM whose weights are the dequantized ones
(fp8.float() * scale_inv, block by block, in torch). Writes tests/data/fp8/deepseek-v3-tiny-fp8/:
config.json, model.safetensors, expected.safetensors (input_ids, logits), with the library
versions in the metadata.

    python3 tools/make_fp8_goldens.py [--shared ../shared]
"""
import argparse
import json
import os
import re

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
BLOCK = 128
QUANTIZED = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\..*(_proj|experts\.\d+\.\w+_proj)\.weight$")


def quantize(w):
    rows, cols = w.shape
    br, bc = (rows + BLOCK - 1) // BLOCK, (cols + BLOCK - 1) // BLOCK
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scale = torch.empty(br, bc, dtype=torch.float32)
    for i in range(br):
        for j in range(bc):
            blk = w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK]
            s = blk.abs().max().clamp(min=1e-12) / 448.0
            scale[i, j] = s
            q[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = (blk / s).to(torch.float8_e4m3fn)
    return q, scale


def dequantize(q, scale):
    rows, cols = q.shape
    s = scale.repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]
    return q.to(torch.float32) * s


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shared", default=os.path.join(HERE, "..", "..", "shared"))
    args = ap.parse_args()
    src = os.path.join(args.shared, "fixtures", "models", "deepseek-v3-tiny")
    out = os.path.join(HERE, "..", "tests", "data", "fp8", "deepseek-v3-tiny-fp8")
    os.makedirs(out, exist_ok=True)
    weights = load_file(os.path.join(src, "model.safetensors"))
    stored, dequantized = {}, {}
    for name, w in weights.items():
        if QUANTIZED.match(name) and w.dim() == 2:
            q, s = quantize(w.float())
            stored[name], stored[name + "_scale_inv"] = q, s
            dequantized[name] = dequantize(q, s)
        else:
            stored[name] = w
            dequantized[name] = w
    meta = {"torch": torch.__version__, "transformers": transformers.__version__}
    save_file(stored, os.path.join(out, "model.safetensors"), metadata=meta)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [BLOCK, BLOCK]}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="eager").eval()
    # transformers keeps a layer's experts fused: gate_up_proj [E, 2I, D] and down_proj [E, D, I].
    fused = {}
    for name in list(dequantized):
        m = re.match(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+)_proj\.weight$", name)
        if m:
            fused.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = dequantized.pop(name)
    for prefix, experts in fused.items():
        order = sorted(experts)
        dequantized[prefix + ".gate_up_proj"] = torch.stack([torch.cat([experts[e]["gate"], experts[e]["up"]]) for e in order])
        dequantized[prefix + ".down_proj"] = torch.stack([experts[e]["down"] for e in order])
    missing, unexpected = model.load_state_dict(dequantized, strict=False)
    assert not [m for m in missing if "rotary" not in m] and not unexpected, (missing, unexpected)
    torch.manual_seed(0)
    ids = torch.randint(0, config["vocab_size"], (2, 24))
    with torch.no_grad():
        logits = model(ids).logits.float()
    save_file({"input_ids": ids, "logits": logits.contiguous()}, os.path.join(out, "expected.safetensors"), metadata=meta)
    print(f"{sum(1 for n in stored if n.endswith('_scale_inv'))} weights in FP8; wrote {out}")


if __name__ == "__main__":
    main()
