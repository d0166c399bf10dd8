#!/usr/bin/env python3
"""Writes tests/data/tokenizer/goldens.json: GPT-2 BPE token ids for a varied set of byte strings.

Reference for valid UTF-8 text: tiktoken's "gpt2" encoding,
    ids = enc.encode(text, allowed_special="all")      (and enc.encode_ordinary(text)).
Reference for invalid UTF-8 (tiktoken only takes str): an independent splitter written here with
the `regex` module. The bytes are decoded with errors="surrogateescape", so each byte that is not
part of a valid UTF-8 sequence becomes one lone surrogate (category Cs: neither letter, number nor
White_Space, i.e. "other"); the GPT-2 pattern, with \\s spelled out as the White_Space set, splits
that string; each piece goes back to bytes with surrogateescape and is BPE'd by tiktoken alone
(enc._encode_single_piece). Before using it, the script asserts that this splitter reproduces
tiktoken exactly on every valid text. src/tokenizer/README.md explains the invalid-UTF-8 rule.

Usage: python3 tools/make_tokenizer_goldens.py [--shared ../shared] [--out tests/data/tokenizer/goldens.json]
Needs: pip install tiktoken regex. Deterministic (fixed seed).
"""
import argparse
import base64
import json
import pathlib
import random

import regex
import tiktoken
import tiktoken.load

EOT = "<|endoftext|>"
EOT_ID = 50256
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# The Unicode White_Space property (what \s means in tiktoken's Rust regex), written out.
WS = r"\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
REF_SPLIT = regex.compile(
    rf"'(?:[sdmt]|ll|ve|re)| ?\p{{L}}+| ?\p{{N}}+| ?[^{WS}\p{{L}}\p{{N}}]+|[{WS}]+(?![^{WS}])|[{WS}]+")


def load_encoding(shared: pathlib.Path) -> tiktoken.Encoding:
    local = tiktoken.Encoding(
        name="gpt2-local",
        pat_str=GPT2_PATTERN,
        mergeable_ranks=tiktoken.load.data_gym_to_mergeable_bpe_ranks(
            vocab_bpe_file=str(shared / "data/gpt2/vocab.bpe"),
            encoder_json_file=str(shared / "data/gpt2/encoder.json")),
        special_tokens={EOT: EOT_ID},
        explicit_n_vocab=50257)
    try:
        official = tiktoken.get_encoding("gpt2")
    except Exception as e:  # no network: the local files are the same data
        print(f"tiktoken.get_encoding('gpt2') unavailable ({type(e).__name__}); using {shared}/data/gpt2")
        return local
    probe = "Hello world's 123 \u00e9\u4e2d\U0001F600  \n\t<|endoftext|>x"
    assert official.encode(probe, allowed_special="all") == local.encode(probe, allowed_special="all")
    return official


def ref_encode(enc: tiktoken.Encoding, data: bytes, *, specials: bool) -> list[int]:
    """The independent reference: works on any byte string."""
    out = []
    segments = data.split(EOT.encode()) if specials else [data]
    for k, seg in enumerate(segments):
        if k:
            out.append(EOT_ID)
        text = seg.decode("utf-8", errors="surrogateescape")
        for m in REF_SPLIT.finditer(text):
            out.extend(enc._encode_single_piece(m.group().encode("utf-8", errors="surrogateescape")))
    return out


# ------------------------------------------------------------------------------------------------
# Hand-written cases.

PROSE = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age "
    "of foolishness, it was the epoch of belief, it was the epoch of incredulity. The quick brown "
    "fox jumps over the lazy dog! Isn't it? We'll see; they're sure you've got what I'd want.\n\n"
    "Mr. O'Neil paid $1,234.56 on 2024-03-15 for 3 items (about 7.5% off) -- e-mail: a.b@c.org.")

CODE = '''#include <vector>
int main(int argc, char** argv) {
    std::vector<int> v{1, 2, 3};
\tfor (auto& x : v) x *= 2;  // double it
    if (argc > 1 && argv[1][0] == '-') return -1;
    return 0;
}

def f(x: int) -> str:
    """Docstring with 'quotes' and "double quotes"."""
    return f"{x:>10}"   \t
'''

CASES = [
    ("empty", ""),
    ("single_space", " "),
    ("english_prose", PROSE),
    ("source_code", CODE),
    ("spaces_runs", "a  b   c    d     e" + " " * 17 + "f"),
    ("trailing_spaces", "end with spaces   "),
    ("leading_spaces", "   start"),
    ("only_spaces", "     "),
    ("tabs", "\tx\t\ty\t\t\t z \t"),
    ("newlines", "line1\nline2\n\nline3\n\n\n  indented\n"),
    ("crlf", "a\r\nb\r\n\r\nc \r\n d"),
    ("mixed_ws", " \t \n \r\n\t\t  \x0b\x0c x  \n\n  y\n \t"),
    ("ws_before_punct", "x  !  ?   .\t,\n;"),
    ("numbers", "0 1 12 123 1234 12345 123456 3.14159 -42 +7 1e10 0x1F 1,000,000 007"),
    ("unicode_numbers", "\u0663\u0664 \uff11\uff12 \u00b2\u00b3 \u00bd \u2167\u216b \u2460 \u0967\u0968"),
    ("punctuation", "!!! ??? ... --- ((())) [[]] {{}} <<>> ;;; ::: \"\" '' `` ~~ @# $% ^& *_ += |\\ /"),
    ("contractions", "it's It'S he'll HE'LL they're THEY'RE we've I'm I'd don't can't 'tis 'twas"),
    ("contraction_edges", "'s 'S 'll 'Ll 're 've 'm 'd 't 'x ''s '' ' 's' x's's 'ss 'lll"),
    ("apostrophe_spaces", " 's  'll\t're\n've"),
    ("emoji", "Hi \U0001F600 \U0001F44D\U0001F3FD \u2764\ufe0f \U0001F1EF\U0001F1F5 done"),
    ("emoji_zwj", "\U0001F468\u200d\U0001F469\u200d\U0001F467\u200d\U0001F466 \U0001F3F3\ufe0f\u200d\U0001F308 "
                  "\U0001F9D1\U0001F3FD\u200d\U0001F4BB"),
    ("cjk", "\u6211\u7231\u5317\u4eac\u5929\u5b89\u95e8\u3002\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3001"
            "\ud55c\uad6d\uc5b4 \ud14d\uc2a4\ud2b8"),
    ("arabic", "\u0627\u0644\u0633\u0644\u0627\u0645 \u0639\u0644\u064a\u0643\u0645 \u0661\u0662\u0663 \u0645\u064e\u0631\u0652\u062d\u064e\u0628\u064b\u0627"),
    ("hindi", "\u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e \u0939\u093f\u0928\u094d\u0926\u0940"),
    ("cyrillic", "\u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440! \u0401\u0436\u0438\u043a \u0438 \u0449\u0451\u0442\u043a\u0430."),
    ("greek_accents", "\u039a\u03b1\u03bb\u03b7\u03bc\u03ad\u03c1\u03b1 caf\u00e9 na\u00efve \u00c5ngstr\u00f6m stra\u00dfe"),
    ("combining_marks", "e\u0301 a\u0300\u0300 o\u0308\u0304 n\u0303 \u0301 x\u20dd Z\u0351\u0364\u036b"),
    ("letter_kinds", "\u01c5 \u02b0\u02b1 \u3005 \u1100\u1161 \u00aa\u00ba \u2c00"),
    ("endoftext_inside", f"Hello{EOT}world {EOT} x{EOT}{EOT}\n{EOT}"),
    ("endoftext_ws_edges", f"a  {EOT}  b\n\n{EOT}\t"),
    ("endoftext_partial", "<|endoftext <|endoftext| <|endoftex|> <| |> <<|endoftext|>>"),
    ("unicode_spaces", "a\u00a0b \u00a0c\u3000d\u2028e\u0085f \u2029 g\u1680h\u2002i\u2003j\u2009k\u200al\u202fm\u205fn"),
    ("unicode_space_runs", "x\u00a0\u00a0y \u3000\u3000z\u2028\u2028\u0085 \u00a0"),
    ("non_ws_spaces", "zero\u200bwidth\u200cjoin\u200dnon\u2060word\ufeffbom \u180e"),
    ("control_chars", "\x00\x01\x02 a\x07b\x1b[31mred\x1b[0m\x7f \x1c\x1d\x1e\x1f \x80\x9f"),
    ("nul_inside", "a\x00b\x00\x00 c"),
    ("long_word", "Pneumonoultramicroscopicsilicovolcanoconiosis " * 3),
    ("long_digits", "31415926535897932384626433832795028841971693993751058209749445923078164"),
    ("long_punct", "=" * 80 + "\n" + "-=" * 40 + "\n" + "\u2500" * 30),
    ("url_json", 'GET https://example.com/a/b?x=1&y=two#frag {"k": [1, 2.5, null], "s": "v\\n"}'),
    ("math_symbols", "\u2200x\u2208\u211d: x\u00b2 \u2265 0 \u2211\u222b\u221e \u2260 \u00b1 \u00d7 \u00f7"),
    ("private_use_and_astral", "\ue000\uf8ff \U0001D400\U0001D41A \U00020000\U0002A6D6 \U0001F9EA"),
    ("mixed_scripts", "English \u4e2d\u6587 \u0420\u0443\u0441 \u0639\u0631\u0628\u064a 123 \U0001F600 it's"),
]

# Invalid UTF-8 byte strings (raw bytes).
INVALID = [
    ("lone_continuation", b"abc\x80def \x80\xbf"),
    ("lone_lead", b"x\xc3 y\xe2 z\xf0"),
    ("truncated_3byte", b"euro \xe2\x82 then \xe2\x82\xac"),
    ("truncated_4byte", b"\xf0\x9f\x98 smile \xf0\x9f\x98\x80"),
    ("overlong", b"\xc0\x80 \xc1\xbf \xe0\x80\x80 \xf0\x80\x80\x80 A"),
    ("surrogates", b"\xed\xa0\x80\xed\xbf\xbf pair"),
    ("above_max", b"\xf4\x90\x80\x80 \xf5\x80\x80\x80 \xff\xfe"),
    ("all_ff", b"\xff" * 20),
    ("invalid_then_space", b"\xff \xfe  \xfd\t\xfc\n"),
    ("space_then_invalid", b" \x80 \x81a \x82 1"),
    ("invalid_in_words", b"hel\xfflo wor\x80ld 12\xff34"),
    ("invalid_with_punct", b"!\x80?\xff.. \xc3(."),
    ("invalid_and_apostrophe", b"'\x80s \xff's x'\xffll"),
    ("invalid_and_eot", b"\xff<|endoftext|>\x80 <|endoftext|>\xe2\x82"),
    ("latin1_text", "Ca f\u00e9 na\u00efve \u00e0 la cr\u00e8me".encode("latin-1")),
    ("utf16_text", "Hi \u4e2d".encode("utf-16")),
    ("valid_then_cut", "\u4e2d\u6587".encode()[:-1]),
    ("all_bytes", bytes(range(256))),
]


# ------------------------------------------------------------------------------------------------
# Random strings mixing the categories above (fixed seed).

POOLS = {
    "word": ["the", "The", "quick", "fox", "tokenizer", "a", "I", "Hello", "world", "UPPER", "x", "ing"],
    "digits": ["0", "7", "42", "2024", "3.14", "1,000", "99999999"],
    "punct": list("!\"#$%&()*+,-./:;<=>?@[\\]^_`{|}~") + ["...", "--", "->", "==", "'"],
    "space": [" ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n", "\x0b", "\x0c"],
    "uspace": ["\u00a0", "\u3000", "\u2028", "\u2029", "\u0085", "\u1680", "\u2000", "\u2007", "\u200a",
               "\u202f", "\u205f", "\u200b", "\u180e", "\ufeff"],
    "contraction": ["'s", "'S", "'ll", "'LL", "'re", "'ve", "'m", "'d", "'t", "'T", "n't", "'"],
    "emoji": ["\U0001F600", "\U0001F44D\U0001F3FD", "\u2764\ufe0f", "\U0001F1EF\U0001F1F5",
              "\U0001F468\u200d\U0001F469\u200d\U0001F467", "\U0001F3F3\ufe0f\u200d\U0001F308", "\u2603"],
    "cjk": ["\u4e2d", "\u6587\u5b57", "\u3042\u3044", "\u30ab\u30bf", "\ud55c", "\u3002", "\uff01"],
    "script": ["\u0627\u0644\u0639", "\u0928\u092e\u0938\u094d", "\u041f\u0440\u0438", "\u05e9\u05dc\u05d5\u05dd",
               "\u0e2a\u0e27\u0e31", "\u10d0\u10d1", "\u0394\u03b4"],
    "combining": ["\u0301", "\u0300\u0308", "e\u0301", "\u093f", "\u064e", "\u20dd"],
    "number_other": ["\u0663", "\uff11", "\u00b2", "\u00bd", "\u2167", "\u2460", "\u0967"],
    "control": ["\x00", "\x01", "\x07", "\x1b", "\x1f", "\x7f", "\x80", "\x9f"],
    "special": [EOT, "<|", "|>", "<|endoftext", "endoftext|>"],
}


def random_text(rng: random.Random) -> str:
    keys = list(POOLS)
    n = rng.randint(1, 30)
    return "".join(rng.choice(POOLS[rng.choice(keys)]) for _ in range(n))


INVALID_FRAGMENTS = [b"\x80", b"\xbf", b"\xc0", b"\xc1\x81", b"\xc3", b"\xe2\x82", b"\xed\xa0\x80",
                     b"\xf0\x9f", b"\xf4\x90\x80\x80", b"\xf8", b"\xfe", b"\xff", b"\xe0\x80\xaf"]


def random_bytes(rng: random.Random) -> bytes:
    parts = []
    for _ in range(rng.randint(1, 25)):
        r = rng.random()
        if r < 0.45:
            parts.append(rng.choice(POOLS[rng.choice(list(POOLS))]).encode())
        elif r < 0.8:
            parts.append(rng.choice(INVALID_FRAGMENTS))
        else:
            parts.append(bytes(rng.randrange(256) for _ in range(rng.randint(1, 4))))
    return b"".join(parts)


def main() -> None:
    root = pathlib.Path(__file__).resolve().parent.parent
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shared", type=pathlib.Path, default=root.parent / "shared")
    ap.add_argument("--out", type=pathlib.Path, default=root / "tests/data/tokenizer/goldens.json")
    ap.add_argument("--random", type=int, default=300, help="random valid and random invalid cases, each")
    args = ap.parse_args()

    enc = load_encoding(args.shared)
    rng = random.Random(20240531)

    # Long pieces (the C++ side merges pieces over 96 bytes with a heap instead of a scan).
    long_valid = [
        ("long_letters", "".join(rng.choice("abcdefghijklmnop") for _ in range(400))),
        ("long_letters_repeat", "ab" * 150 + " " + "aaa" * 100),
        ("long_caps_digits", "".join(rng.choice("QWERTYUIOP") for _ in range(200)) + " " + "9" * 300),
        ("long_cjk", "".join(chr(rng.randrange(0x4E00, 0x9FA0)) for _ in range(150))),
        ("long_symbols", "".join(rng.choice("!#$%&*+-/<=>?@^_|~") for _ in range(300))),
        ("long_spaces", " " * 300 + "x" + "\t" * 200 + "\n" * 150),
    ]
    long_invalid = [("long_invalid_run", bytes(rng.randrange(0x80, 0x100) for _ in range(300)))]
    valid = list(CASES) + long_valid + [(f"random_text_{i}", random_text(rng)) for i in range(args.random)]
    invalid = list(INVALID) + long_invalid + [(f"random_bytes_{i}", random_bytes(rng)) for i in range(args.random)]

    cases = []
    for name, text in valid:
        data = text.encode("utf-8")
        ids = enc.encode(text, allowed_special="all")
        ordinary = enc.encode_ordinary(text)
        # The independent splitter must agree with tiktoken wherever tiktoken can be asked.
        assert ref_encode(enc, data, specials=True) == ids, f"reference splitter differs on {name}: {text!r}"
        assert ref_encode(enc, data, specials=False) == ordinary, f"reference splitter differs on {name}"
        assert enc.decode_bytes(ids) == data
        case = {"name": name, "utf8": True, "bytes_b64": base64.b64encode(data).decode(), "ids": ids}
        if ordinary != ids:
            case["ids_ordinary"] = ordinary
        cases.append(case)
    for name, data in invalid:
        try:
            data.decode("utf-8")
            utf8 = True
        except UnicodeDecodeError:
            utf8 = False
        ids = ref_encode(enc, data, specials=True)
        ordinary = ref_encode(enc, data, specials=False)
        if utf8:  # a random byte string can happen to be valid: then tiktoken itself is the judge
            assert ids == enc.encode(data.decode(), allowed_special="all"), name
        assert enc.decode_bytes(ids) == data, name
        case = {"name": name, "utf8": utf8, "bytes_b64": base64.b64encode(data).decode(), "ids": ids}
        if ordinary != ids:
            case["ids_ordinary"] = ordinary
        cases.append(case)

    doc = {
        "about": "GPT-2 BPE goldens: ids = tiktoken gpt2 encode(allowed_special='all') for valid UTF-8; "
                 "for invalid UTF-8 the surrogateescape reference of tools/make_tokenizer_goldens.py. "
                 "ids_ordinary (encode_ordinary) is given where it differs.",
        "generator": "tools/make_tokenizer_goldens.py",
        "tiktoken_version": tiktoken.__version__,
        "cases": cases,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(doc, separators=(",", ":"))
    # One case per line keeps diffs readable.
    text = text.replace(',{"name"', ',\n{"name"')
    args.out.write_text(text + "\n")
    n_bad = sum(1 for c in cases if not c["utf8"])
    print(f"wrote {args.out}: {len(cases)} cases ({n_bad} invalid UTF-8), {args.out.stat().st_size} bytes")


if __name__ == "__main__":
    main()
