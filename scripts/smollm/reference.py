"""An independent NumPy forward pass of the GGUF Llama model, to check floe-smollm.

Reads the GGUF through the `gguf` package (its own reader and dequantisers), runs the
forward pass in float64 for the token ids floe-smollm wrote, and compares logits.

    reference.py MODEL.gguf LOGITS.npy [LOGITS2.npy ...]

Each LOGITS.npy is [T, vocab] from `floe-smollm --logits`, with LOGITS.npy.tokens.npy
beside it. The figure of merit, per file:

    max relative difference = max over tokens t of  max_v |l_cpp[t,v] - l_ref[t,v]|
                                                    -----------------------------
                                                         max_v |l_ref[t,v]|

(the infinity-norm error of each token's logit vector relative to its infinity norm).
Exits non-zero when it exceeds --tol (default 1e-3).
"""
import argparse
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


def field(reader, key):
    f = reader.fields[key]
    value = f.parts[f.data[0]]
    if f.types[0].name == "STRING":
        return bytes(value).decode("utf-8")
    return value[0].item()


def weight(reader, name):
    t = next(t for t in reader.tensors if t.name == name)
    w = dequantize(t.data, t.tensor_type)
    return np.asarray(w, dtype=np.float64).reshape([int(d) for d in reversed(t.shape)])


def forward(reader, tokens):
    n_layer = field(reader, "llama.block_count")
    n_head = field(reader, "llama.attention.head_count")
    n_kv = field(reader, "llama.attention.head_count_kv")
    theta = field(reader, "llama.rope.freq_base")
    eps = field(reader, "llama.attention.layer_norm_rms_epsilon")
    embd = weight(reader, "token_embd.weight")            # [vocab, E]
    E = embd.shape[1]
    hd = E // n_head
    T = len(tokens)

    def rms(x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w

    # Llama RoPE as ggml applies it to GGUF weights: rotate pairs (2i, 2i+1).
    pos = np.arange(T, dtype=np.float64)[:, None]
    angle = pos * theta ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)[None, :]   # [T, hd/2]
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]

    def rope(x):                                           # x [T, H, hd]
        even, odd = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = even * cos - odd * sin
        out[..., 1::2] = even * sin + odd * cos
        return out

    mask = np.triu(np.full((T, T), -np.inf), k=1)
    x = embd[np.asarray(tokens)]
    for l in range(n_layer):
        p = f"blk.{l}."
        h = rms(x, weight(reader, p + "attn_norm.weight"))
        q = rope((h @ weight(reader, p + "attn_q.weight").T).reshape(T, n_head, hd))
        k = rope((h @ weight(reader, p + "attn_k.weight").T).reshape(T, n_kv, hd))
        v = (h @ weight(reader, p + "attn_v.weight").T).reshape(T, n_kv, hd)
        k = np.repeat(k, n_head // n_kv, axis=1)           # query head j uses KV head j // group
        v = np.repeat(v, n_head // n_kv, axis=1)
        scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd) + mask
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        scores /= scores.sum(axis=-1, keepdims=True)
        att = np.einsum("hts,shd->thd", scores, v).reshape(T, E)
        x = x + att @ weight(reader, p + "attn_output.weight").T
        h = rms(x, weight(reader, p + "ffn_norm.weight"))
        gate = h @ weight(reader, p + "ffn_gate.weight").T
        up = h @ weight(reader, p + "ffn_up.weight").T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ weight(reader, p + "ffn_down.weight").T
    names = {t.name for t in reader.tensors}
    out = weight(reader, "output.weight") if "output.weight" in names else embd
    return rms(x, weight(reader, "output_norm.weight")) @ out.T


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("logits", nargs="+")
    ap.add_argument("--tol", type=float, default=1e-3)
    args = ap.parse_args()
    reader = GGUFReader(args.model)
    worst = 0.0
    cache = {}
    for path in args.logits:
        cpp = np.load(path).astype(np.float64)
        tokens = tuple(np.load(path + ".tokens.npy").tolist())
        if tokens not in cache:
            cache[tokens] = forward(reader, list(tokens))
        ref = cache[tokens]
        per_token = np.abs(cpp - ref).max(axis=1) / np.abs(ref).max(axis=1)
        agree = np.mean(cpp.argmax(axis=1) == ref.argmax(axis=1))
        print(f"{path}: {len(tokens)} tokens, max relative difference {per_token.max():.3e} "
              f"(median {np.median(per_token):.3e}), max |diff| {np.abs(cpp - ref).max():.3e}, "
              f"argmax agreement {agree:.3f}")
        worst = max(worst, per_token.max())
    print(f"worst max relative difference {worst:.3e} (tolerance {args.tol:g}): "
          f"{'PASS' if worst <= args.tol else 'FAIL'}")
    return 0 if worst <= args.tol else 1


if __name__ == "__main__":
    sys.exit(main())
