"""Compares floe-smollm's token ids with Hugging Face `tokenizers` on the same text.

The reference tokenizer is built from the GGUF's vocabulary and merges with the
pre-tokenizer SmolLM2 ships (individual digits, then GPT-2 byte-level split):

    check_tokenizer.py MODEL.gguf TEXT CHARS IDS.npy
"""
import sys

import numpy as np
from gguf import GGUFReader
from tokenizers import Tokenizer, decoders, models, pre_tokenizers


def strings(reader, key):
    f = reader.fields[key]
    return [bytes(f.parts[i]).decode("utf-8") for i in f.data]


def main():
    model, text_path, chars, ids_path = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    reader = GGUFReader(model)
    vocab = {t: i for i, t in enumerate(strings(reader, "tokenizer.ggml.tokens"))}
    merges = [tuple(m.split(" ", 1)) for m in strings(reader, "tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    with open(text_path, encoding="utf-8") as f:
        text = f.read()[:chars]
    expected = tok.encode(text).ids
    got = np.load(ids_path).tolist()
    first = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), None)
    same = got == expected
    print(f"{text_path}: {chars} characters, {len(got)} tokens (reference {len(expected)}): "
          f"{'identical' if same else 'DIFFER'}" + ("" if same or first is None else f" from token {first}"))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
