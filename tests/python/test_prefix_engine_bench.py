"""benchmarks/prefix_engine_bench.py --quick on the CPU: the video-QA trace
through mixkv.Engine with prefix caching off, on for FP16 plans, and by
content for WindowQuant plans; checks the JSON it writes (a few seconds)."""

import json
import os
import pathlib
import subprocess
import sys

import mixkv
import pytest

pytest.importorskip("torch", reason="the bench runs the model in torch")

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "prefix_engine_bench.py"
RUNS = ("off", "fp16-prefix", "wq-content")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("prefix_engine") / "prefix_engine.json"
    env = dict(os.environ)
    # The bench imports the mixkv this test imported, wherever it comes from.
    package_dir = str(pathlib.Path(mixkv.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_dir, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, str(BENCH), "--quick", "--device", "cpu", "--no-progress", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    with open(out) as f:
        data = json.load(f)
    data["stdout"] = proc.stdout
    return data


def runs_by_name(result):
    return {e["run"]: e for e in result["runs"]}


def test_every_run_is_in_the_json(result):
    runs = runs_by_name(result)
    assert set(RUNS) <= set(runs)
    assert result["meta"]["device"] == "cpu"
    assert result["meta"]["trace"]["requests"] > 0
    assert "table" in result and "from cache" in result["table"]


def test_runs_without_the_cache_and_with_fp16_plans(result):
    runs = runs_by_name(result)
    for name in ("off", "fp16-prefix"):
        e = runs[name]
        assert "error" not in e, e.get("error")
        assert e["output_tokens"] > 0
        assert e["ttft_ms_p50"] is not None and e["ttft_ms_p50"] <= e["ttft_ms_p99"]
        assert e["prefill_tokens_computed"] >= e["scheduler_prefill_tokens"] > 0
    off, fp16 = runs["off"], runs["fp16-prefix"]
    assert off["cache_share"] == 0 and off["cached_prompt_tokens"] == 0
    assert off["prefill_tokens_computed"] >= off["prompt_tokens_asked"]
    # The same video asked again takes its system text and video from the cache.
    assert fp16["cache_share"] > 0 and fp16["prefix_hits"] > 0
    assert fp16["prefill_tokens_computed"] < off["prefill_tokens_computed"]
    assert fp16["index_bytes"] > 0
    assert 0 < fp16["videos_held"] <= fp16["videos_asked"]
    assert fp16["videos_per_gib"] > 0


def test_content_identity_run_shares_the_video(result):
    if not hasattr(mixkv, "PrefixIdentity"):
        pytest.skip("mixkv.PrefixIdentity is missing: this build has no content identity")
    e = runs_by_name(result)["wq-content"]
    if "error" in e:
        if "InvalidArgument" in e["error"] or "identity" in e["error"]:
            pytest.skip(f"the Scheduler rejects content identity in this build: {e['error']}")
        pytest.fail(e["error"])
    assert e["config"]["prefill_mode"] == "Exact"
    assert "identity=PrefixIdentity.Content" in e["config"]["prefix_cache"]
    assert e["cache_share"] > 0 and e["prefix_hits"] > 0
    assert e["plan_demotions"] > 0  # each request decodes at its own plan
    assert e["output_tokens"] == runs_by_name(result)["off"]["output_tokens"]
    assert 0 < e["videos_held"] <= e["videos_asked"]
