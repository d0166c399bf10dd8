#!/usr/bin/env python3
"""Makes the tokenizer-format fixtures and their goldens (development time only; needs the
`tokenizers` and `tiktoken` packages; nothing is downloaded).

Each fixture is a small byte-level BPE vocabulary trained here by Hugging Face `tokenizers` on the
multilingual corpus (tests/data/tokenizer/multilingual.json), with the text pipeline of one model
family as its public files describe it:

  deepseek-v3   tokenizer.json: Split(\\p{N}{1,3}) + Split(kana/CJK runs) + Split(DeepSeek's letter,
                punctuation and space pattern) + ByteLevel, no normalizer
  qwen3         tokenizer.json: NFC + Split(Qwen2's pattern) + ByteLevel
  pipeline-mix  tokenizer.json: NFKC + Lowercase, Digits(individual), Split("-", MergedWithNext),
                Split(" ", Removed), ByteLevel(use_regex) -- the other steps and behaviors
  kimi          tiktoken.model + tokenizer_config.json (TikTokenTokenizer): Kimi's split pattern,
                ranks from the trained vocabulary, 256 special ids after it (a few named in
                added_tokens_decoder, the rest <|reserved_token_ID|>)

goldens.json holds, per fixture, the ids `tokenizers` (Tokenizer.encode, add_special_tokens=False)
or `tiktoken` (Encoding.encode, allowed_special="all") gives for every corpus text and for the
whole corpus joined, with the library versions.

  python3 tools/make_tokenizer_fixtures.py   (writes tests/data/tokenizer/formats/)
"""
import base64
import json
import os
import sys

import tiktoken
import tokenizers
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "tokenizer")
OUT = os.path.join(ROOT, "formats")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

DEEPSEEK_SPLITS = [
    r"\p{N}{1,3}",
    r"[一-龥\u3040-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
]
QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                r"|\s+(?!\S)|\s+")
KIMI_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])


def byte_level_tokenizer(normalizer, pre_tokenizer):
    tok = Tokenizer(models.BPE())
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    return tok


def train(tok, corpus, vocab_size=1200):
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=1, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus * 3, trainer=trainer)
    return tok


def hf_fixture(name, tok, texts, joined):
    d = os.path.join(OUT, name)
    os.makedirs(d, exist_ok=True)
    tok.save(os.path.join(d, "tokenizer.json"))
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|endoftext|>", "tokenizer_class": "PreTrainedTokenizerFast"}, f, indent=1)
    tok = Tokenizer.from_file(os.path.join(d, "tokenizer.json"))  # the saved file is what is checked
    return {"texts": [tok.encode(t, add_special_tokens=False).ids for t in texts],
            "joined": tok.encode(joined, add_special_tokens=False).ids, "reference": "tokenizers"}


def kimi_fixture(trained, texts, joined):
    d = os.path.join(OUT, "kimi")
    os.makedirs(d, exist_ok=True)
    # Ranks: the trained byte-level vocabulary's ids, as bytes (specials left out).
    byte_decoder = {c: b for b, c in zip(range(256), [chr(c) for c in _bytes_to_unicode()])}
    vocab = trained.get_vocab()
    ranks = {}
    for text, i in sorted(vocab.items(), key=lambda kv: kv[1]):
        if text in SPECIALS:
            continue
        ranks[bytes(byte_decoder[c] for c in text)] = len(ranks)
    with open(os.path.join(d, "tiktoken.model"), "w") as f:
        for b, r in ranks.items():
            f.write(base64.b64encode(b).decode() + " " + str(r) + "\n")
    n = len(ranks)
    named = {n: "[BOS]", n + 1: "[EOS]", n + 2: "<|im_end|>", n + 3: "<|im_user|>", n + 4: "<|im_assistant|>",
             n + 7: "[EOT]", n + 8: "<|im_system|>", n + 9: "<|im_middle|>", n + 255: "[PAD]"}
    cfg = {"tokenizer_class": "TikTokenTokenizer",
           "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
           "eos_token": "[EOS]",
           "added_tokens_decoder": {str(i): {"content": c, "lstrip": False, "normalized": False, "rstrip": False,
                                             "single_word": False, "special": True} for i, c in named.items()}}
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(n, n + 256)}
    enc = tiktoken.Encoding(name="kimi-fixture", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens=specials)
    # The corpus's own special-token texts are GPT-2/ChatML ones; Kimi's appear in these two.
    kimi_texts = texts + ["[BOS]hello<|im_user|>user<|im_middle|>你好<|im_end|>[EOS]",
                          f"reserved <|reserved_token_{n + 5}|> and [PAD] end"]
    return {"texts": [enc.encode(t, allowed_special="all") for t in kimi_texts],
            "joined": enc.encode(joined, allowed_special="all"), "reference": "tiktoken",
            "extra_texts": kimi_texts[len(texts):]}


def _bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    order = dict(zip(bs, cs))
    return [order[b] for b in range(256)]


def main():
    with open(os.path.join(ROOT, "multilingual.json"), encoding="utf-8") as f:
        texts = json.load(f)
    joined = "\n".join(texts)
    corpus = [t.replace("<|endoftext|>", "").replace("<|im_start|>", "").replace("<|im_end|>", "") for t in texts]
    out = {"about": "ids of the fixtures in formats/ for multilingual.json's texts (and for them joined by newlines), "
                    "from the reference library named per fixture",
           "generator": "tools/make_tokenizer_fixtures.py",
           "tokenizers_version": tokenizers.__version__, "tiktoken_version": tiktoken.__version__, "fixtures": {}}

    ds = byte_level_tokenizer(None, pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in DEEPSEEK_SPLITS] +
        [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]))
    out["fixtures"]["deepseek-v3"] = hf_fixture("deepseek-v3", train(ds, corpus), texts, joined)

    qw = byte_level_tokenizer(normalizers.NFC(), pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated"),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]))
    out["fixtures"]["qwen3"] = hf_fixture("qwen3", train(qw, corpus), texts, joined)

    mix = byte_level_tokenizer(normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()]), pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.Split("-", behavior="merged_with_next"),
         pre_tokenizers.Split(" ", behavior="removed"),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]))
    out["fixtures"]["pipeline-mix"] = hf_fixture("pipeline-mix", train(mix, corpus), texts, joined)

    km = byte_level_tokenizer(None, pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(KIMI_PATTERN), behavior="isolated"),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]))
    out["fixtures"]["kimi"] = kimi_fixture(train(km, corpus), texts, joined)

    with open(os.path.join(ROOT, "format_goldens.json"), "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, separators=(",", ":"))
    for k, v in out["fixtures"].items():
        print(k, sum(len(x) for x in v["texts"]), "ids over", len(v["texts"]), "texts", file=sys.stderr)


if __name__ == "__main__":
    main()
