"""A plain paged KV cache with its own continuous-batching scheduler: what
the FlashInfer backend (flashinfer_backend.py) stores K/V in, and, with
torch attention over the same pages, a reference backend that runs on the
CPU (tests).

The scheduler follows mixkv's policy so that the two caches are compared
under one admission rule (docs/scheduler.md): every running request decodes
one token a step; prompts are prefilled in chunks within a token budget
(decodes first, then prompts already admitted, oldest first, then new
ones); a request is admitted, first come first served, when the pages of
its whole prompt plus the watermark are free, and takes its pages at
admission; a decode that needs a page and finds none preempts the newest
running request by recompute (its pages are freed and it is prefilled again
later, its prompt followed by the tokens it generated). A request whose
prompt and new tokens could never fit the cache is rejected.

Pages are shared by all layers (one page id a block of page_size tokens in
every layer), K and V each [layers, pages, page_size, kv_heads, head_dim]
(FlashInfer's NHD layout, one tensor a layer), float16 or float8 e4m3.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class Prefill:
    request_id: str
    start: int
    end: int
    last: bool


@dataclass
class Finished:
    request_id: str
    reason: str
    generated: int


@dataclass
class Rejected:
    request_id: str
    reason: str


@dataclass
class Step:
    """One step's batch, with the attributes of mixkv.EngineStep that the serving loop reads."""

    prefills: list = field(default_factory=list)
    decodes: list = field(default_factory=list)
    finished: list = field(default_factory=list)
    rejected: list = field(default_factory=list)
    preempted: list = field(default_factory=list)

    @property
    def prefill_rows(self) -> int:
        return sum(p.end - p.start for p in self.prefills)


@dataclass
class _Seq:
    id: str
    prompt_len: int
    max_new: int
    order: int
    generated: int = 0
    computed: int = 0  # rows whose K/V are stored
    total: int = 0  # rows to prefill: the prompt, then after a recompute the prompt and the generated tokens
    pages: list = field(default_factory=list)
    row: int = -1  # its row of the page table while it holds pages
    state: str = "waiting"  # waiting, prefilling, running
    finish_requested: bool = False


class PagedScheduler:
    """Continuous batching over `num_pages` pages of `page_size` tokens (see the module docstring)."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        watermark: float = 0.01,
        max_tokens_per_request: int = 8192,
    ):
        if num_pages < 1:
            raise ValueError(f"num_pages = {num_pages}: expected >= 1 (the budget holds no page)")
        if page_size < 1:
            raise ValueError(f"page_size = {page_size}: expected >= 1")
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_seqs = {max_num_seqs}, max_num_batched_tokens = {max_num_batched_tokens}: expected >= 1"
            )
        self.num_pages = num_pages
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.max_tokens = max_num_batched_tokens
        self.watermark_pages = int(watermark * num_pages)
        self.free = list(range(num_pages - 1, -1, -1))  # a stack: low page ids first
        # The page table, one row a live request with pages: the step's slots and FlashInfer's tables are
        # gathered from it with NumPy, not built request by request.
        self.max_pages_per_seq = math.ceil(max_tokens_per_request / page_size) + 1
        self.table = np.zeros((max_num_seqs, self.max_pages_per_seq), dtype=np.int32)
        self.free_rows = list(range(max_num_seqs - 1, -1, -1))
        self.seqs: dict[str, _Seq] = {}
        self.waiting: deque[_Seq] = deque()
        self.active: list[_Seq] = []  # prefilling and running, in admission order
        self.last = Step()
        self.pending_finished: list[Finished] = []
        self.pending_rejected: list[Rejected] = []
        self.order = 0
        self.preemptions = 0

    # ---- requests -------------------------------------------------------
    def add(self, request_id: str, prompt_len: int, max_new_tokens: int):
        if request_id in self.seqs:
            raise ValueError(f"add: request_id = {request_id!r}: already a live request")
        if prompt_len < 1 or max_new_tokens < 1:
            raise ValueError(f"add: {request_id!r}: prompt_len and max_new_tokens must be >= 1")
        self.order += 1
        seq = _Seq(request_id, prompt_len, max_new_tokens, self.order, total=prompt_len)
        need = math.ceil((prompt_len + max_new_tokens - 1) / self.page_size)
        if need > self.max_pages_per_seq:
            raise ValueError(
                f"add: {request_id!r}: {prompt_len} + {max_new_tokens} tokens exceed max_tokens_per_request"
            )
        if need > self.num_pages:
            self.pending_rejected.append(
                Rejected(request_id, f"needs {need} pages with its new tokens, the cache holds {self.num_pages}")
            )
            return
        self.seqs[request_id] = seq
        self.waiting.append(seq)

    def finish(self, request_id: str) -> bool:
        seq = self.seqs.get(request_id)
        if seq is None or seq.finish_requested:
            return False
        seq.finish_requested = True
        return True

    def has_unfinished(self) -> bool:
        return bool(self.seqs) or bool(self.pending_finished) or bool(self.pending_rejected)

    def pages_of(self, request_id: str):
        return self.seqs[request_id].pages

    def used_pages(self) -> int:
        return self.num_pages - len(self.free)

    # ---- one step ---------------------------------------------------------
    def _release(self, seq: _Seq):
        self.free.extend(reversed(seq.pages))
        seq.pages = []
        if seq.row >= 0:
            self.free_rows.append(seq.row)
            seq.row = -1

    def _take_page(self, seq: _Seq):
        page = self.free.pop()
        self.table[seq.row, len(seq.pages)] = page
        seq.pages.append(page)

    def _preempt(self, seq: _Seq, step: Step):
        self._release(seq)
        self.active.remove(seq)
        seq.state = "waiting"
        seq.computed = 0
        seq.total = seq.prompt_len + seq.generated
        # Back in arrival order among the waiting requests (it arrived before any request admitted after it).
        index = next((i for i, w in enumerate(self.waiting) if w.order > seq.order), len(self.waiting))
        self.waiting.insert(index, seq)
        step.preempted.append(seq.id)
        self.preemptions += 1

    def step(self) -> Step:
        # What the previous step computed.
        for p in self.last.prefills:
            seq = self.seqs.get(p.request_id)
            if seq is None:
                continue
            seq.computed = p.end
            if p.last:
                seq.generated += 1
                seq.state = "running"
        for rid in self.last.decodes:
            seq = self.seqs.get(rid)
            if seq is not None:
                seq.computed += 1
                seq.generated += 1
        step = Step(finished=self.pending_finished, rejected=self.pending_rejected)
        self.pending_finished, self.pending_rejected = [], []

        def done(seq):
            return seq.finish_requested or (seq.state == "running" and seq.generated >= seq.max_new)

        leaving = [s for s in self.active if done(s)] + [s for s in self.waiting if done(s)]
        if leaving:
            self.active = [s for s in self.active if not done(s)]
            self.waiting = deque(s for s in self.waiting if not done(s))
            for seq in leaving:
                self._release(seq)
                del self.seqs[seq.id]
                step.finished.append(Finished(seq.id, "stopped" if seq.finish_requested else "length", seq.generated))

        # Decodes: a page for each new token that opens one, preempting the newest running requests if needed.
        running = deque(s for s in self.active if s.state == "running")
        decodes = []
        while running:
            seq = running.popleft()
            need = seq.computed // self.page_size + 1 - len(seq.pages)  # the new token sits at row `computed`
            while need > len(self.free):
                # The newest running request not yet given its row this step, else this one.
                victim = running.pop() if running else seq
                self._preempt(victim, step)
                if victim is seq:
                    break
            if seq.state != "running":
                continue
            for _ in range(max(0, need)):
                self._take_page(seq)
            decodes.append(seq)
        step.decodes = [s.id for s in decodes]
        budget = self.max_tokens - len(decodes)

        # Prompts admitted before, oldest first.
        for seq in self.active:
            if seq.state == "prefilling" and budget > 0:
                n = min(seq.total - seq.computed, budget)
                step.prefills.append(Prefill(seq.id, seq.computed, seq.computed + n, seq.computed + n == seq.total))
                budget -= n
        # Admission, first come first served, never in a step that preempted.
        while self.waiting and not step.preempted and budget > 0 and len(self.active) < self.max_num_seqs:
            seq = self.waiting[0]
            need = math.ceil(seq.total / self.page_size)
            # The watermark keeps room for the running requests' growth; alone, a request needs none.
            if need + (self.watermark_pages if self.active else 0) > len(self.free):
                break
            self.waiting.popleft()
            seq.row = self.free_rows.pop()
            for _ in range(need):
                self._take_page(seq)
            seq.state = "prefilling"
            seq.computed = 0
            self.active.append(seq)
            n = min(seq.total, budget)
            step.prefills.append(Prefill(seq.id, 0, n, n == seq.total))
            budget -= n
        self.last = step
        return step

    # ---- the step's page arithmetic -----------------------------------------
    def slots(self, request_id: str, start: int, end: int) -> np.ndarray:
        """Flat slots (page * page_size + offset) of rows [start, end) of a request."""
        seq = self.seqs[request_id]
        rows = np.arange(start, end)
        return self.table[seq.row, rows // self.page_size].astype(np.int64) * self.page_size + rows % self.page_size

    def decode_slots(self, ids, positions) -> np.ndarray:
        """The slot of row positions[i] of request ids[i], for all i at once."""
        rows = np.fromiter((self.seqs[r].row for r in ids), dtype=np.int64, count=len(ids))
        pos = np.asarray(positions, dtype=np.int64)
        return self.table[rows, pos // self.page_size].astype(np.int64) * self.page_size + pos % self.page_size

    def kv_table(self, ids, lengths):
        """FlashInfer's CSR page table of sequences `ids` holding `lengths` tokens: (indptr, indices,
        last_page_len), int32 NumPy."""
        lengths = np.asarray(lengths, dtype=np.int64)
        counts = (lengths + self.page_size - 1) // self.page_size
        indptr = np.zeros(len(ids) + 1, dtype=np.int32)
        indptr[1:] = np.cumsum(counts)
        if len(ids) == 0:
            return indptr, np.zeros(0, np.int32), np.zeros(0, np.int32)
        rows = np.fromiter((self.seqs[r].row for r in ids), dtype=np.int64, count=len(ids))
        width = int(counts.max())
        mask = np.arange(width)[None, :] < counts[:, None]
        indices = self.table[rows, :width][mask]  # row-major: each sequence's pages in order
        last = (lengths - (counts - 1) * self.page_size).astype(np.int32)
        return indptr, np.ascontiguousarray(indices, dtype=np.int32), last


class PagedKVBackend:
    """A paged K/V cache (float16 or float8 e4m3) under PagedScheduler, with torch float32 attention over
    the pages: the reference for FlashInferBackend's bookkeeping, which only replaces the attention."""

    name = "paged-torch"

    def __init__(
        self,
        config,
        budget_bytes: int,
        device,
        kv_dtype=torch.float16,
        page_size: int = 16,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        max_tokens_per_request: int = 8192,
    ):
        c = config
        self.config = c
        self.device = torch.device(device)
        self.kv_dtype = kv_dtype
        self.page_size = page_size
        elem = torch.empty((), dtype=kv_dtype).element_size()
        self.page_bytes = c.num_layers * 2 * page_size * c.num_kv_heads * c.head_dim * elem
        num_pages = budget_bytes // self.page_bytes
        if num_pages < 1:
            raise ValueError(f"budget {budget_bytes} bytes: expected >= one page of every layer ({self.page_bytes})")
        self.sched = PagedScheduler(
            num_pages, page_size, max_num_seqs, max_num_batched_tokens, max_tokens_per_request=max_tokens_per_request
        )
        dims = (c.num_layers, num_pages, page_size, c.num_kv_heads, c.head_dim)
        # Stored as bytes for float8 (index_put is not defined on float8 tensors); read through a view.
        store = torch.uint8 if elem == 1 else kv_dtype
        self.k = torch.zeros(dims, dtype=store, device=self.device)
        self.v = torch.zeros(dims, dtype=store, device=self.device)
        self.sm_scale = 1.0 / math.sqrt(c.head_dim)
        self.peak_pages = 0

    def kv(self, layer: int):
        """Layer `layer`'s (K, V) pages as the attention reads them: [pages, page_size, kv_heads, d]."""
        if self.k.dtype == torch.uint8:
            return self.k[layer].view(self.kv_dtype), self.v[layer].view(self.kv_dtype)
        return self.k[layer], self.v[layer]

    # ---- the serving loop's interface ---------------------------------------
    def add(self, request):
        self.sched.add(request.id, request.prompt.num_tokens, request.max_new_tokens)

    def finish(self, request_id) -> bool:
        return self.sched.finish(request_id)

    def has_unfinished(self) -> bool:
        return self.sched.has_unfinished()

    def used_bytes(self) -> int:
        return self.sched.used_pages() * self.page_bytes

    def step(self) -> Step:
        step = self.sched.step()
        self.peak_pages = max(self.peak_pages, self.sched.used_pages())
        s = self.sched
        dev = self.device
        # Prefill rows: their slots, and each chunk's table over its rows so far (the chunk included).
        self.chunks = [(p.request_id, p.start, p.end) for p in step.prefills]
        if self.chunks:
            slots = np.concatenate([s.slots(r, a, b) for r, a, b in self.chunks])
            self.prefill_slots = torch.as_tensor(slots).to(dev)
            qo = np.zeros(len(self.chunks) + 1, dtype=np.int32)
            qo[1:] = np.cumsum([b - a for _, a, b in self.chunks])
            self.prefill_qo = qo
            self.prefill_table = s.kv_table([r for r, _, _ in self.chunks], [b for _, _, b in self.chunks])
        # Decode rows: the new token at row `computed` of each request, attending to computed + 1 rows.
        self.decode_ids = list(step.decodes)
        if self.decode_ids:
            rows = np.fromiter(
                (s.seqs[r].computed for r in self.decode_ids), dtype=np.int64, count=len(self.decode_ids)
            )
            self.decode_slots = torch.as_tensor(s.decode_slots(self.decode_ids, rows)).to(dev)
            self.decode_table = s.kv_table(self.decode_ids, rows + 1)
            self.decode_rows = rows
        self.plan_step(step)
        return step

    def plan_step(self, step):
        """Per-step planning of the attention (FlashInferBackend's plan() calls)."""

    def _store(self, layer: int, k, v, slots):
        kc, vc = self.k[layer], self.v[layer]
        flat_k = kc.view(-1, *kc.shape[2:])
        flat_v = vc.view(-1, *vc.shape[2:])
        if kc.dtype == torch.uint8:
            k = k.to(self.kv_dtype).view(torch.uint8)
            v = v.to(self.kv_dtype).view(torch.uint8)
        flat_k[slots] = k
        flat_v[slots] = v

    def prefill(self, layer: int, q, k, v):
        self._store(layer, k, v, self.prefill_slots)
        return self.prefill_attention(layer, q)

    def attend_into(self, layer: int, q, k, v, out):
        self._store(layer, k, v, self.decode_slots)
        self.decode_attention(layer, q, out)
        return out

    # ---- attention (torch, float32) -----------------------------------------
    def _gather(self, layer: int, table, i: int):
        indptr, indices, last = table
        kc, vc = self.kv(layer)
        pages = torch.as_tensor(indices[indptr[i] : indptr[i + 1]].astype(np.int64)).to(self.device)
        n = (len(pages) - 1) * self.page_size + int(last[i])
        shape = (-1, *kc.shape[2:])
        return kc[pages].reshape(shape)[:n].to(torch.float16), vc[pages].reshape(shape)[:n].to(torch.float16)

    def prefill_attention(self, layer: int, q):
        from torch_model import attention_fp32

        out = torch.empty_like(q)
        for i, (_, a, _end) in enumerate(self.chunks):
            k, v = self._gather(layer, self.prefill_table, i)
            rows = slice(int(self.prefill_qo[i]), int(self.prefill_qo[i + 1]))
            out[rows] = attention_fp32(q[rows], k, v, causal_offset=a)
        return out

    def decode_attention(self, layer: int, q, out):
        """All decode rows at once: each row's keys gathered by slot into a padded batch, the padding masked."""
        import math as m

        if layer == 0 or getattr(self, "_gathered_step", None) is not self.decode_table:
            lengths = np.asarray(self.decode_rows) + 1
            width = int(lengths.max())
            slots = np.zeros((len(lengths), width), dtype=np.int64)
            for i, r in enumerate(self.decode_ids):
                slots[i, : lengths[i]] = self.sched.slots(r, 0, int(lengths[i]))
            self._slots = torch.as_tensor(slots).to(self.device)
            self._hidden = torch.as_tensor(np.arange(width)[None, :] >= lengths[:, None]).to(self.device)
            self._gathered_step = self.decode_table
        kc, vc = self.kv(layer)
        k = kc.reshape(-1, *kc.shape[2:])[self._slots].float()  # [b, width, kv_heads, d]
        v = vc.reshape(-1, *vc.shape[2:])[self._slots].float()
        b, heads, d = q.shape
        qf = q.float().view(b, k.shape[2], -1, d)
        scores = torch.einsum("bkgd,bmkd->bkgm", qf, k) / m.sqrt(d)
        p = torch.softmax(scores.masked_fill(self._hidden[:, None, None, :], float("-inf")), dim=-1)
        out.copy_(torch.einsum("bkgm,bmkd->bkgd", p, v).reshape(b, heads, d).half())

    def describe(self) -> dict:
        return {
            "page_size": self.page_size,
            "pages": self.sched.num_pages,
            "page_bytes": self.page_bytes,
            "kv_dtype": str(self.kv_dtype).replace("torch.", ""),
            "peak_bytes": self.peak_pages * self.page_bytes,
            "preemptions": self.sched.preemptions,
        }

    def close(self):
        self.k = self.v = None
