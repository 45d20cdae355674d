"""A Llama-shaped decoder with random weights, tensor parallel over
torch.distributed, whose KV cache is mixkv on every rank.

Megatron's split: rank r of tp holds query heads [r * Hq/tp, (r+1) * Hq/tp)
and KV heads [r * Hkv/tp, (r+1) * Hkv/tp) (q/k/v projections split by
columns, the output projection by rows) and 1/tp of the MLP's hidden units
(gate and up by columns, down by rows). Each layer sums the row-split
products with two all-reduces, one after attention and one after the MLP.
Embedding, norms and the LM head are replicated, so every rank ends a step
with the same logits.

Weights are drawn per head (attention) and per MLP slice of ffn / 8 units,
each from a generator seeded by (seed, layer, matrix, unit), so a model of
any tp in {1, 2, 4, 8} is the same model cut differently: a tp = 2 run can
be compared with a tp = 1 run. The residual stream, norms and RoPE are
float32; the matrix products take the weights' dtype (float32 on the CPU,
float16 on a GPU); q, k and v reach mixkv as float16.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

# The MLP is drawn in this many slices, so tp may be any divisor of it.
MLP_SLICES = 8


@dataclass(frozen=True)
class ModelConfig:
    num_layers: int = 3
    hidden: int = 512
    num_heads: int = 8
    num_kv_heads: int = 4
    head_dim: int = 64
    ffn: int = 1024
    vocab: int = 512
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    seed: int = 0

    def validate(self, tp: int) -> None:
        """ValueError naming the field that does not split over tp ranks."""
        if tp < 1 or MLP_SLICES % tp != 0:
            raise ValueError(f"tp = {tp}: expected a divisor of {MLP_SLICES} (1, 2, 4 or 8)")
        for name in ("num_heads", "num_kv_heads"):
            if getattr(self, name) % tp != 0:
                raise ValueError(f"ModelConfig.{name} = {getattr(self, name)}: expected a multiple of tp = {tp}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"ModelConfig.num_heads = {self.num_heads}: expected a multiple of num_kv_heads = {self.num_kv_heads}"
            )
        if self.ffn % MLP_SLICES != 0:
            raise ValueError(f"ModelConfig.ffn = {self.ffn}: expected a multiple of {MLP_SLICES}")


SMALL = ModelConfig()
# Llama-3-8B's attention shape (32 query / 8 KV heads of 128) on fewer layers: the benchmark's model.
LLAMA8B_SHAPE = ModelConfig(
    num_layers=8, hidden=4096, num_heads=32, num_kv_heads=8, head_dim=128, ffn=14336, vocab=32000, rope_theta=500000.0
)


def _draw(shape: tuple, fan_in: int, seed: int, device: torch.device) -> torch.Tensor:
    """N(0, 1/fan_in) values from a generator seeded by `seed`, on `device`
    (a device's generator draws the same values for the same seed on every
    rank)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return torch.randn(shape, generator=generator, device=device, dtype=torch.float32) / math.sqrt(fan_in)


def _seed(*parts: int) -> int:
    """A 63-bit seed from small ints, the same in every process and for
    every tp: one weight block's seed depends on its own indices only."""
    value = 0x9E3779B97F4A7C15
    for p in parts:
        value = (value ^ (p + 0x9E3779B97F4A7C15)) * 0xBF58476D1CE4E5B9 & ((1 << 64) - 1)
        value ^= value >> 31
    return value & ((1 << 63) - 1)


class TPLlama:
    """One rank's shard of the model. ``group``: the torch.distributed group
    of the tp ranks (None when tp is 1)."""

    def __init__(
        self,
        config: ModelConfig,
        tp_rank: int = 0,
        tp_size: int = 1,
        group: Any = None,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        config.validate(tp_size)
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank = {tp_rank}: expected 0 <= tp_rank < tp_size = {tp_size}")
        if tp_size > 1 and group is None:
            import torch.distributed as dist

            group = dist.group.WORLD
        self.config, self.rank, self.tp, self.group = config, tp_rank, tp_size, group
        self.device = torch.device(device)
        self.dtype = dtype
        c = config
        self.heads = c.num_heads // tp_size
        self.kv_heads = c.num_kv_heads // tp_size
        d, h = c.head_dim, c.hidden
        my_heads = range(tp_rank * self.heads, (tp_rank + 1) * self.heads)
        my_kv = range(tp_rank * self.kv_heads, (tp_rank + 1) * self.kv_heads)
        my_slices = range(tp_rank * MLP_SLICES // tp_size, (tp_rank + 1) * MLP_SLICES // tp_size)
        unit = c.ffn // MLP_SLICES
        dev = self.device

        def cols(layer: int, matrix: int, units: range, width: int) -> torch.Tensor:
            # [hidden, len(units) * width]: one block of columns per head or MLP slice.
            blocks = [_draw((h, width), h, _seed(c.seed, layer, matrix, u), dev) for u in units]
            return torch.cat(blocks, 1).to(dtype)

        def rows(layer: int, matrix: int, units: range, width: int, fan_in: int) -> torch.Tensor:
            # [len(units) * width, hidden]: one block of rows per head or MLP slice.
            blocks = [_draw((width, h), fan_in, _seed(c.seed, layer, matrix, u), dev) for u in units]
            return torch.cat(blocks, 0).to(dtype)

        self.layers = []
        for layer in range(c.num_layers):
            self.layers.append(
                {
                    "wq": cols(layer, 0, my_heads, d),
                    "wk": cols(layer, 1, my_kv, d),
                    "wv": cols(layer, 2, my_kv, d),
                    "wo": rows(layer, 3, my_heads, d, c.num_heads * d),
                    "w_gate": cols(layer, 4, my_slices, unit),
                    "w_up": cols(layer, 5, my_slices, unit),
                    "w_down": rows(layer, 6, my_slices, unit, c.ffn),
                }
            )
        self.embed = _draw((c.vocab, h), 1, _seed(c.seed, 1 << 20), dev)
        self.lm_head = _draw((h, c.vocab), h, _seed(c.seed, 1 << 21), dev).to(dtype)
        self.inv_freq = 1.0 / c.rope_theta ** (torch.arange(0, d, 2, device=dev, dtype=torch.float32) / d)
        self.comm_seconds = 0.0  # time in all-reduce, for the benchmark

    # -- pieces -----------------------------------------------------------------------------------------------------
    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + self.config.rms_eps)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Llama's rotate-half RoPE; x [rows, heads, head_dim] float32."""
        angles = positions.to(torch.float32)[:, None] * self.inv_freq[None]
        cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None]
        sin = torch.cat([angles.sin(), angles.sin()], -1)[:, None]
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rotated * sin

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums the ranks' partial products (float32, so the sum's order
        costs ~1e-7 relative, not an FP16 rounding)."""
        if self.tp == 1:
            return x
        import time

        import torch.distributed as dist

        start = time.perf_counter()
        try:
            dist.all_reduce(x, group=self.group)
        except RuntimeError as error:
            raise RuntimeError(
                f"rank {self.rank}: the model's all-reduce failed: another rank raised or exited, or the group's "
                f"timeout passed ({type(error).__name__}: {error})"
            ) from error
        self.comm_seconds += time.perf_counter() - start
        return x

    def _matmul(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (x.to(w.dtype) @ w).to(torch.float32)

    # -- a step -----------------------------------------------------------------------------------------------------
    def forward(
        self,
        engine: Any,
        prefill_tokens: torch.Tensor,
        prefill_positions: torch.Tensor,
        decode_tokens: torch.Tensor,
        decode_positions: torch.Tensor,
    ) -> torch.Tensor:
        """One step: the prefill rows (attending through the cache, Engine.
        prefill) then the decode rows (Engine.attend), every layer, this
        rank's heads. Returns the hidden states [prefill rows + decode
        rows, hidden] float32 after the last layer, equal on every rank."""
        c = self.config
        num_prefill = int(prefill_tokens.shape[0])
        tokens = torch.cat([prefill_tokens, decode_tokens]).to(self.device)
        positions = torch.cat([prefill_positions, decode_positions]).to(self.device)
        rows = int(tokens.shape[0])
        h = self.embed[tokens]
        for layer, w in enumerate(self.layers):
            x = self._norm(h)
            q = self._rope(self._matmul(x, w["wq"]).view(rows, self.heads, c.head_dim), positions)
            k = self._rope(self._matmul(x, w["wk"]).view(rows, self.kv_heads, c.head_dim), positions)
            v = self._matmul(x, w["wv"]).view(rows, self.kv_heads, c.head_dim)
            q, k, v = (t.to(torch.float16).contiguous() for t in (q, k, v))
            parts = []
            if num_prefill:
                p = slice(0, num_prefill)
                parts.append(engine.prefill(layer, q[p], k[p], v[p]))
            if rows > num_prefill:
                d = slice(num_prefill, rows)
                parts.append(engine.attend(layer, q[d], k[d], v[d]))
            attention = torch.cat(parts).to(torch.float32).view(rows, self.heads * c.head_dim)
            h = h + self._all_reduce(self._matmul(attention, w["wo"]))
            x = self._norm(h)
            gated = F.silu(self._matmul(x, w["w_gate"])) * self._matmul(x, w["w_up"])
            h = h + self._all_reduce(self._matmul(gated, w["w_down"]))
        return h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """[rows, vocab] float32 (the LM head is replicated: no all-gather)."""
        return self._matmul(self._norm(h), self.lm_head)

    def embeddings(self, tokens: list) -> Any:
        """A prompt's input embeddings as a float32 NumPy array, for the
        WindowQuant planner (which reads host memory)."""
        return self.embed[torch.tensor(tokens, device=self.device)].cpu().numpy()
