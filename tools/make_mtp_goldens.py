#!/usr/bin/env python3
"""Reference for k3's multi-token-prediction head (models/mtp.h) on deepseek-v3-tiny.

Loads ../shared/fixtures/models/deepseek-v3-tiny with transformers, gives it one MTP layer with
seeded random weights (a transformers DeepseekV3DecoderLayer with layer index num_hidden_layers,
RMSNorms enorm / hnorm / shared_head.norm, eh_proj and shared_head.head), and computes, for a
fixed sequence of T tokens, the MTP logits of rows 0 .. T-2 (row i: the model's final hidden
state at i and the embedding of token i+1, at position i), then one draft row at position T-1 fed
the head's own output of row T-2 and that row's greedy pick. The composition follows DeepSeek-V3
§2.2 as served by vLLM and SGLang: eh_proj(cat(enorm(embed), hnorm(hidden))), the block, then
shared_head.norm and shared_head.head. Writes tests/data/mtp/deepseek_v3_tiny_mtp.safetensors: the
MTP weights by their checkpoint names (model.layers.3.*, as transformers saves a 4-layer model),
`ids`, `mtp_logits` [T-1, V] and `draft_logits` [1, V], with the library versions in the metadata.

    python3 tools/make_mtp_goldens.py [--shared ../shared]
"""
import argparse
import os
import tempfile

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shared", default=os.path.join(HERE, "..", "..", "shared"))
    args = ap.parse_args()
    src = os.path.join(args.shared, "fixtures", "models", "deepseek-v3-tiny")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="eager").eval()
    cfg = model.config
    L, D, V, eps = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size, cfg.rms_norm_eps

    layer = ds.DeepseekV3DecoderLayer(cfg, layer_idx=L).eval()
    enorm, hnorm, norm = (ds.DeepseekV3RMSNorm(D, eps=eps) for _ in range(3))
    eh_proj = torch.nn.Linear(2 * D, D, bias=False)
    head = torch.nn.Linear(D, V, bias=False)
    with torch.no_grad():
        for mod in (layer, enorm, hnorm, norm, eh_proj, head):
            for name, p in list(mod.named_parameters()) + list(mod.named_buffers()):
                if "norm" in name or p.ndim == 1 and mod in (enorm, hnorm, norm):
                    p.copy_(1.0 + 0.2 * torch.randn_like(p))
                elif p.ndim == 1:
                    p.copy_(0.05 * torch.randn_like(p))
                else:
                    p.copy_(0.08 * torch.randn_like(p))

    T = 12
    ids = torch.tensor([[3, 17, 250, 41, 99, 7, 7, 300, 12, 480, 5, 66]])
    assert ids.shape[1] == T
    with torch.no_grad():
        h = model.model(input_ids=ids).last_hidden_state[0]  # after the final norm

        def mtp(prev, tokens, positions):
            e = enorm(model.model.embed_tokens(tokens))
            x = eh_proj(torch.cat([e, hnorm(prev)], dim=-1))[None]
            n = x.shape[1]
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            pos = torch.tensor([positions])
            cos_sin = model.model.rotary_emb(x, pos)
            o = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
            o = o[0] if isinstance(o, tuple) else o
            return o[0]

        rows = list(range(T - 1))
        o = mtp(h[:-1], ids[0, 1:], rows)
        logits = head(norm(o))
        pick = int(logits[-1].argmax())
        o2 = mtp(torch.cat([h[:-1], o[-1:]]), torch.cat([ids[0, 1:], torch.tensor([pick])]), rows + [T - 1])
        draft_logits = head(norm(o2[-1:]))

    # Checkpoint names: a 4-layer copy of the model saved by transformers, layer 3 the MTP block.
    cfg4 = transformers.AutoConfig.from_pretrained(src)
    cfg4.num_hidden_layers = L + 1
    big = AutoModelForCausalLM.from_config(cfg4, dtype=torch.float32)
    big.model.layers[L].load_state_dict(layer.state_dict())
    with tempfile.TemporaryDirectory() as tmp:
        big.save_pretrained(tmp)
        saved = load_file(os.path.join(tmp, "model.safetensors"))
    prefix = f"model.layers.{L}."
    out = {k: v.contiguous() for k, v in saved.items() if k.startswith(prefix)}
    out[prefix + "enorm.weight"] = enorm.weight.detach().clone()
    out[prefix + "hnorm.weight"] = hnorm.weight.detach().clone()
    out[prefix + "eh_proj.weight"] = eh_proj.weight.detach().clone()
    out[prefix + "shared_head.norm.weight"] = norm.weight.detach().clone()
    out[prefix + "shared_head.head.weight"] = head.weight.detach().clone()
    out[prefix + "embed_tokens.weight"] = model.model.embed_tokens.weight.detach().clone()
    out["ids"] = ids[0].clone()
    out["mtp_logits"] = logits.contiguous()
    out["draft_logits"] = draft_logits.contiguous()
    dst = os.path.join(HERE, "..", "tests", "data", "mtp", "deepseek_v3_tiny_mtp.safetensors")
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    save_file(out, dst, metadata={"torch": torch.__version__, "transformers": transformers.__version__,
                                  "source": "tools/make_mtp_goldens.py"})
    print(f"wrote {dst}: {len(out)} tensors; row picks {logits.argmax(-1).tolist()}, draft {int(draft_logits.argmax())}")


if __name__ == "__main__":
    main()
