"""The video-QA trace of benchmarks/prefix_engine_bench.py: videos asked with
Zipf popularity, each request a system text, a video and its own question
(token ids for the model, keys for Request.token_keys), Poisson arrivals,
and a plan per request (all FP16, or WindowQuant-like from its own seed:
about 10% FP16, 30% INT4, 60% INT2 windows, window 0 FP16)."""

import mixkv
import numpy as np

VISUAL_KEY_BIT = 1 << 63  # visual keys never equal a text token id


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


class Prompt:
    """A request's prompt: token ids (model input), keys (Request.token_keys) and layout."""

    def __init__(self, video, system_ids, visual_ids, visual_keys, question_ids):
        self.video = video
        self.ids = np.concatenate([system_ids, visual_ids, question_ids]).astype(np.int64)
        self.keys = np.concatenate([system_ids.astype(np.uint64), visual_keys, question_ids.astype(np.uint64)]).astype(
            np.uint64
        )
        self.layout = mixkv.TokenLayout(
            [
                mixkv.Segment(mixkv.TokenKind.Text, len(system_ids)),
                mixkv.Segment(mixkv.TokenKind.Visual, len(visual_ids)),
                mixkv.Segment(mixkv.TokenKind.Text, len(question_ids)),
            ]
        )
        self.num_tokens = len(self.ids)
        self.video_end = len(system_ids) + len(visual_ids)


class Trace:
    """The video-QA trace: videos' visual rows, requests (prompt, plan seed, new tokens, arrival step)."""

    def __init__(self, args, vocab, num_layers):
        self.args = args
        self.vocab = vocab
        self.num_layers = num_layers
        rng = np.random.default_rng(args.seed)
        text_lo = min(8, vocab - 1)
        self.text_lo = text_lo
        self.system_ids = rng.integers(text_lo, vocab, args.system_tokens)
        rows = args.frames * args.tokens_per_frame
        self.visual = []
        for v in range(args.videos):
            h = np.asarray([splitmix64((args.seed << 48) ^ (v << 24) ^ r) for r in range(rows)], dtype=np.uint64)
            keys = h | np.uint64(VISUAL_KEY_BIT)
            ids = (h % np.uint64(vocab - text_lo)).astype(np.int64) + text_lo  # the "visual tokens" the model reads
            self.visual.append((ids, keys))
        n = args.videos * args.questions
        popularity = 1.0 / np.arange(1, args.videos + 1)
        self.video_of = rng.choice(args.videos, size=n, p=popularity / popularity.sum())
        gaps = rng.exponential(1.0 / args.arrivals_per_step, n)
        self.arrival_step = np.floor(np.cumsum(gaps) - gaps[0]).astype(np.int64)
        lo, hi = args.new_range
        self.new_tokens = rng.integers(lo, hi + 1, n)
        self.requests = [self.prompt(int(v), rng) for v in self.video_of]
        self.plan_seeds = rng.integers(0, 2**63 - 1, n)
        # Per-layer threshold shift of the plans (as prefix_sim): fixed for the trace.
        self.layer_shift = rng.uniform(-0.05, 0.05, num_layers)
        self._plans = {}

    def plans(self, kind):
        """Every request's plan of `kind`, made once (the engine copies what it is given)."""
        if kind not in self._plans:
            self._plans[kind] = [self.plan(kind, p, s) for p, s in zip(self.requests, self.plan_seeds)]
        return self._plans[kind]

    def prompt(self, video, rng):
        ids, keys = self.visual[video]
        question = rng.integers(self.text_lo, self.vocab, int(rng.integers(10, 41)))
        return Prompt(video, self.system_ids, ids, keys, question)

    def plan(self, kind, prompt, seed):
        """The request's plan: all FP16 ('fp16'), or WindowQuant-like ('wq') from its own seed."""
        windows = prompt.layout.num_windows(self.args.block_size)
        plan = mixkv.PrecisionPlan(self.num_layers, windows, mixkv.Precision.FP16)
        if kind == "fp16":
            return plan
        rng = np.random.default_rng(int(seed))
        u = rng.random((self.num_layers, windows))
        for layer in range(self.num_layers):
            s = self.layer_shift[layer]
            for w in range(1, windows):  # window 0 stays FP16
                x = u[layer, w]
                if x < 0.6 + s:
                    plan.set(layer, w, mixkv.Precision.INT2)
                elif x < 0.9 + s:
                    plan.set(layer, w, mixkv.Precision.INT4)
        return plan
