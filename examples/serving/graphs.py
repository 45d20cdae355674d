"""Runs the model's rows for the serving loop: eagerly for steps with prompt
chunks, and for decode-only steps as CUDA graphs around attention.

A decode step is L + 1 graph pieces with L attention calls between them
(piecewise graphs, as vLLM captures them): piece 0 embeds the batch's tokens
and computes layer 0's q/k/v; piece l (1..L-1) finishes layer l - 1 and
computes layer l's q/k/v; piece L finishes the last layer and samples. The
attention calls stay outside the graphs because the cache layer re-plans
its work every step (mixkv.Engine.attend, FlashInfer's run() after plan()),
and both backends are timed the same way. Pieces read and write static
buffers sized for the largest batch; a graph is captured once per batch
bucket (padded rows compute on stale but finite inputs and are never read)
and serves every step of any backend and plan: the graphs hold only the
model.
"""

from __future__ import annotations

import time

import numpy as np
import torch


def batch_buckets(max_batch: int):
    """Batch sizes a graph is captured at: every size up to 8, then steps of at most a quarter of the size
    (padding computes at most a quarter more rows than the step has), ending at max_batch."""
    if max_batch < 1:
        raise ValueError(f"max_batch = {max_batch}: expected >= 1")
    sizes = list(range(1, min(max_batch, 8) + 1))
    b = 8
    while b < max_batch:
        step = 1 << max(0, (b // 4).bit_length() - 1)
        b = min(max_batch, b + step)
        sizes.append(b)
    return sizes


class ModelRunner:
    """Rows through the model with sampling: eager(), and decode() (graphs when `graphs`).

    Sampling is greedy; with logprobs=True each sampled row also gives the log-probability of a target
    token (teacher forcing), which costs a log-softmax over the vocabulary, so the throughput runs leave
    it off."""

    def __init__(self, model, max_batch: int, graphs: bool, logprobs: bool = False):
        if graphs and model.device.type != "cuda":
            raise ValueError("graphs=True: CUDA graphs need the model on a CUDA device")
        self.model = model
        self.max_batch = max_batch
        self.logprobs = logprobs
        self.graphs = {}  # bucket -> [L + 1 CUDA graphs]
        self.capture_seconds = 0.0
        self.use_graphs = graphs
        if graphs:
            self._static_buffers()
            self._capture_all()

    # ---- sampling -------------------------------------------------------
    def _sample(self, h, targets):
        logits = self.model.logits_raw(h)
        best = torch.argmax(logits, dim=-1)
        if not self.logprobs:
            return best, None
        lp = torch.log_softmax(logits.float(), dim=-1).gather(1, targets[:, None])[:, 0]
        return best, lp

    # ---- eager ----------------------------------------------------------
    @torch.no_grad()
    def eager(self, ids, positions, attend, sample_rows, targets=None):
        """ids, positions: int64 NumPy arrays [n]; attend(layer, q, k, v) -> out; sample_rows: the rows
        that sample (indices). Returns (tokens [len(sample_rows)], log-probs of `targets` or None)."""
        m = self.model
        dev = m.device
        ids_t = torch.as_tensor(ids, dtype=torch.int64).to(dev)
        pos_t = torch.as_tensor(positions, dtype=torch.int64).to(dev)
        h = m.forward(ids_t, pos_t, attend)
        rows = torch.as_tensor(np.asarray(sample_rows, dtype=np.int64)).to(dev)
        tgt = torch.as_tensor(np.zeros(len(sample_rows), np.int64) if targets is None else targets).to(dev)
        best, lp = self._sample(h[rows], tgt)
        return best.cpu().numpy(), (None if lp is None else lp.cpu().numpy())

    # ---- graphs ---------------------------------------------------------
    def _static_buffers(self):
        m = self.model
        c = m.config
        dev = m.device
        n = self.max_batch
        self.tok_buf = torch.zeros(n, dtype=torch.int64, device=dev)
        self.pos_buf = torch.zeros(n, dtype=torch.int64, device=dev)
        self.tgt_buf = torch.zeros(n, dtype=torch.int64, device=dev)
        self.h_buf = torch.zeros(n, c.hidden, dtype=torch.float32, device=dev)
        self.q_buf = torch.zeros(n, c.num_heads, c.head_dim, dtype=torch.float16, device=dev)
        self.k_buf = torch.zeros(n, c.num_kv_heads, c.head_dim, dtype=torch.float16, device=dev)
        self.v_buf = torch.zeros_like(self.k_buf)
        self.o_buf = torch.zeros_like(self.q_buf)
        self.best_buf = torch.zeros(n, dtype=torch.int64, device=dev)
        self.lp_buf = torch.zeros(n, dtype=torch.float32, device=dev)

    def _piece(self, i: int, b: int):
        """Piece i of a decode step over the first b rows of the static buffers."""
        m = self.model
        L = m.config.num_layers
        pos = self.pos_buf[:b]
        if i == 0:
            h = m.embed(self.tok_buf[:b])
        else:
            h = m.post(i - 1, self.h_buf[:b], self.o_buf[:b])
        if i < L:
            self.h_buf[:b].copy_(h)
            q, k, v = m.qkv(i, h, pos)
            self.q_buf[:b].copy_(q)
            self.k_buf[:b].copy_(k)
            self.v_buf[:b].copy_(v)
        else:
            best, lp = self._sample(h, self.tgt_buf[:b])
            self.best_buf[:b].copy_(best)
            if lp is not None:
                self.lp_buf[:b].copy_(lp)

    @torch.no_grad()
    def _capture_all(self):
        t0 = time.perf_counter()
        L = self.model.config.num_layers
        # Warm-up outside capture (cuBLAS handles and workspaces, lazy initialisation), on a side stream as
        # torch's CUDA-graph notes ask.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for b in (1, self.max_batch):
                for i in range(L + 1):
                    self._piece(i, b)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        pool = torch.cuda.graph_pool_handle()
        # Largest first: the shared pool is sized by the first capture and reused by the smaller ones.
        for b in reversed(batch_buckets(self.max_batch)):
            graphs = []
            for i in range(L + 1):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    self._piece(i, b)
                graphs.append(g)
            self.graphs[b] = graphs
        torch.cuda.synchronize()
        self.buckets = sorted(self.graphs)
        self.capture_seconds = time.perf_counter() - t0

    def bucket(self, b: int) -> int:
        for size in self.buckets:
            if size >= b:
                return size
        raise ValueError(f"decode batch {b}: expected <= max_batch = {self.max_batch}")

    @torch.no_grad()
    def decode(self, ids, positions, attend_into, targets=None):
        """One decode step of len(ids) rows: ids, positions int64 NumPy arrays; attend_into(layer, q, k, v,
        out) writes the attention of the rows into out. Returns (tokens, log-probs or None) as NumPy."""
        b = len(ids)
        if not self.use_graphs:

            def attend(layer, q, k, v):
                out = torch.empty_like(q)
                attend_into(layer, q, k, v, out)
                return out

            return self.eager(ids, positions, attend, np.arange(b), targets)
        if b > self.max_batch:
            raise ValueError(f"decode batch {b}: expected <= max_batch = {self.max_batch}")
        graphs = self.graphs[self.bucket(b)]
        self.tok_buf[:b].copy_(torch.from_numpy(np.asarray(ids, dtype=np.int64)))
        self.pos_buf[:b].copy_(torch.from_numpy(np.asarray(positions, dtype=np.int64)))
        if self.logprobs and targets is not None:
            self.tgt_buf[:b].copy_(torch.from_numpy(np.asarray(targets, dtype=np.int64)))
        graphs[0].replay()
        for layer in range(self.model.config.num_layers):
            attend_into(layer, self.q_buf[:b], self.k_buf[:b], self.v_buf[:b], self.o_buf[:b])
            graphs[layer + 1].replay()
        best = self.best_buf[:b].cpu().numpy()
        lp = self.lp_buf[:b].cpu().numpy() if self.logprobs else None
        return best, lp
