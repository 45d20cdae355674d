"""Tensor parallelism (mixkv.tp, examples/tp/): two ranks over gloo on the
CPU backend, each holding half the KV heads, against the single-rank run;
memory pressure, forks and cancels; a rank that raises or diverges stopping
the group with an error on every rank. The NCCL runs need two GPUs.

Each multi-rank test starts two processes (examples/tp/launch.py) with a
deadline, so a hang fails the test instead of the suite.
"""

import importlib.util
import os
import pathlib
import subprocess
import sys
import time
from dataclasses import replace

import mixkv
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tp"
HAS_TORCH = importlib.util.find_spec("torch") is not None
needs_torch = pytest.mark.skipif(
    not HAS_TORCH, reason="mixkv.tp runs over torch.distributed and the example model is torch: torch is not installed"
)
# Each launch's deadline: start-up (two torch imports) plus the run, on a loaded 2-core machine.
DEADLINE = 90.0
# A rank waiting on a peer that died gives up after this (the process group's timeout).
COLLECTIVE_TIMEOUT = 20.0
# Logits of the tp run against the single-rank run, relative to the largest logit. The only difference is
# the order of the float32 sums in the row-split products and their all-reduce (~1e-7 relative), which can
# move a K/V value across an FP16 rounding boundary: 2-4e-5 measured with every plan, so 1e-3 (two FP16
# ulps of the largest logit) for FP16 caches. A value that moves so can also move a quantization code
# across its boundary, one whole INT4/INT2 step of that value: up to 1.8e-3 measured under pressure
# (windows demoted to INT2), so 1e-2 where windows are quantized.
LOGIT_TOLERANCE = {"fp16": 1e-3, "quantized": 1e-2}


def _example():
    """examples/tp/run.py and launch.py, imported (they import torch)."""
    if str(EXAMPLE) not in sys.path:
        sys.path.insert(0, str(EXAMPLE))
    import launch
    import run

    return run, launch


def _launch(options, tp=2, dist_backend="gloo"):
    run, launch = _example()
    return launch.launch(
        run.run_rank,
        tp,
        options,
        timeout=DEADLINE,
        dist_backend=dist_backend,
        collective_timeout=COLLECTIVE_TIMEOUT,
    )


def _ok(results):
    for r in results:
        assert r.status == "ok", f"rank {r.rank}: {r.status}: {r.error}\n{r.trace or ''}"
    return [r.value for r in results]


def _assert_equals_single_rank(ranks, reference, plan, exact_tokens=True):
    """Every rank took the single-rank run's decisions step by step (the
    step digests cover block ids, slots, demotions, swaps and page lists)
    and ends with its bookkeeping; logits are within LOGIT_TOLERANCE and
    tokens equal. ``exact_tokens`` False (the CUDA backend): the decode
    plan cuts a sequence's KV into other pieces when a rank holds half the
    (sequence, KV head) pairs, so the attention's float32 sums run in
    another order too, and a near tie may pick another token; 90% equal,
    logits compared up to each request's first difference."""
    run, _ = _example()
    tolerance = LOGIT_TOLERANCE["fp16" if plan == "fp16" and not reference.stats["demotions"] else "quantized"]
    for r in ranks:
        assert r.digests == reference.digests, f"rank {r.rank}: step digests differ from the single-rank run"
        assert r.describe_state == reference.describe_state
        assert r.stats == reference.stats
        c = run.compare(reference, r)
        if exact_tokens:
            assert r.generated == reference.generated
            assert c["tokens_equal"] == c["tokens"] > 0
        else:
            assert c["tokens_equal"] >= 0.9 * c["tokens"] > 0, c
        assert c["max_logit_error"] < tolerance, c


# -- no group needed ------------------------------------------------------------------------------------------------
def test_shard_cache_config_splits_the_kv_heads():
    from mixkv.tp import shard_cache_config

    config = mixkv.CacheConfig(mixkv.CacheShape(3, 4, 64, 32), 8 << 20, 256 << 10, swap_blocks=[5, 6, 7])
    shard = shard_cache_config(config, 2)
    assert (shard.shape.num_layers, shard.shape.num_kv_heads, shard.shape.head_dim, shard.shape.block_size) == (
        3,
        2,
        64,
        32,
    )
    assert (shard.arena_bytes, shard.slab_bytes, list(shard.swap_blocks)) == (8 << 20, 256 << 10, [5, 6, 7])
    assert config.shape.num_kv_heads == 4  # the caller's config is not changed
    with pytest.raises(
        mixkv.InvalidArgument, match=r"cache_config.shape.num_kv_heads = 4: expected a multiple of tp = 3"
    ):
        shard_cache_config(config, 3)
    with pytest.raises(mixkv.InvalidArgument, match=r"tp = 0: expected >= 1"):
        shard_cache_config(config, 0)
    with pytest.raises(mixkv.InvalidArgument, match=r"cache_config: expected a mixkv.CacheConfig"):
        shard_cache_config(config.shape, 2)


@needs_torch
def test_tp_engine_needs_an_initialized_group():
    import torch.distributed as dist
    from mixkv.tp import TPEngine

    assert not dist.is_initialized()
    config = mixkv.CacheConfig(mixkv.CacheShape(2, 2, 64, 32), 4 << 20)
    with pytest.raises(mixkv.InvalidArgument, match="torch.distributed is not initialized"):
        TPEngine(config, num_q_heads=4)


# -- two ranks over gloo, CPU backend -------------------------------------------------------------------------------
@needs_torch
@pytest.mark.parametrize("plan", ["fp16", "int4", "int2", "mixed"])
def test_two_ranks_equal_the_single_rank_run(plan):
    """4 requests arriving one a step, prefill through the cache and decode,
    on two ranks of 2 KV heads each (check on: digests compared every step,
    describe_state() every step)."""
    run, _ = _example()
    options = run.Options(plan=plan)
    ranks = _ok(_launch(options))
    _assert_equals_single_rank(ranks, run.run_single(options, like_tp=2), options.plan)
    fp16, int4, int2 = ranks[0].peak_blocks
    used = {"fp16": (True, False, False), "int4": (True, True, False), "int2": (True, False, True)}
    assert (fp16 > 0, int4 > 0, int2 > 0) == used.get(plan, (True, True, True)), ranks[0].peak_blocks


def _pressure(run, **overrides):
    """6 requests and 2 forks in a 384 KiB arena a rank, a cancel: demotions and preemptions."""
    return run.Options(
        plan="mixed",
        arena_mib=0.375,
        slab_kib=32,
        requests=6,
        new_tokens=16,
        swap_blocks=64,
        forks=((3, 0), (5, 1)),
        cancels=((8, 2),),
        **overrides,
    )


@needs_torch
@pytest.mark.parametrize("preemption", ["swap", "recompute"])
def test_memory_pressure_forks_and_cancels_keep_ranks_identical(preemption):
    """A 384 KiB arena a rank for 6 requests and 2 forks: demotions,
    preemptions (swap or recompute), copy-on-write after the forks and a
    cancel, every step's digest equal on both ranks and to the single-rank
    run's."""
    run, _ = _example()
    options = _pressure(run, preemption=preemption)
    ranks = _ok(_launch(options))
    _assert_equals_single_rank(ranks, run.run_single(options, like_tp=2), options.plan)
    stats = ranks[0].stats
    assert stats["demotions"] > 0 and stats["forks"] == 2 and stats["cancelled"] == 1, stats
    assert stats["preempted_swap" if preemption == "swap" else "preempted_recompute"] > 0, stats


@needs_torch
def test_a_diverged_rank_is_caught_at_that_step():
    """Rank 1 cancels a request behind rank 0's back before step 3: the step
    digests differ at step 3 and both ranks raise TPDivergence naming it."""
    run, _ = _example()
    results = _launch(run.Options(fault=(1, 3, "diverge")))
    for r in results:
        assert r.status == "error", (r.rank, r.status, r.value)
        assert r.error.startswith("TPDivergence: TPEngine.step: step 3: the ranks diverged: step digest"), r.error
        assert "first difference: describe_state() line" in r.error


@needs_torch
def test_a_rank_raising_in_its_step_raises_on_every_rank():
    run, _ = _example()
    results = _launch(run.Options(fault=(1, 2, "step")))
    for r in results:
        assert r.status == "error", (r.rank, r.status)
        assert "TPEngine.step: step 2: rank 1 raised RuntimeError: injected fault in Engine.step at step 2" in r.error


@needs_torch
def test_a_rank_raising_in_the_model_stops_the_group_without_a_hang():
    """Rank 1 raises in its own code before step 2's forward pass and exits;
    rank 0, waiting in the model's all-reduce, raises too, naming the
    failure, well before the launcher's deadline."""
    run, _ = _example()
    start = time.monotonic()
    results = _launch(run.Options(fault=(1, 2, "model")))
    elapsed = time.monotonic() - start
    assert results[1].status == "error" and "injected fault in the model at step 2" in results[1].error
    assert results[0].status == "error", (results[0].status, results[0].error)
    assert "another rank raised or exited, or the group's timeout passed" in results[0].error, results[0].error
    assert elapsed < DEADLINE - 10, elapsed


def _api_rank(rank, tp, _):
    """The calls' contracts on two ranks (run by launch(); returns what it
    saw for the test to check)."""
    import mixkv.tp
    import numpy as np

    seen = {}
    config = mixkv.CacheConfig(mixkv.CacheShape(2, 4, 64, 32), 4 << 20, 256 << 10)
    try:
        mixkv.tp.TPEngine(mixkv.CacheConfig(mixkv.CacheShape(2, 3, 64, 32), 4 << 20), num_q_heads=6)
    except mixkv.InvalidArgument as error:
        seen["heads"] = str(error)
    other = mixkv.CacheConfig(mixkv.CacheShape(2, 4, 64, 32), (4 + 4 * rank) << 20, 256 << 10)
    try:
        mixkv.tp.TPEngine(other, num_q_heads=8)
    except mixkv.InvalidArgument as error:
        seen["config"] = str(error)
    # Two pipeline stages of tp = 1: whole heads on both ranks, one scheduler's decisions on both.
    stages = mixkv.tp.TPEngine(config, num_q_heads=8, tp=1)
    seen["stages"] = (stages.config.cache.shape.num_kv_heads, stages.tp_size, stages.group_size)
    try:
        mixkv.tp.TPEngine(config, num_q_heads=8, tp=3)
    except mixkv.InvalidArgument as error:
        seen["tp"] = str(error)
    engine = mixkv.tp.TPEngine(config, num_q_heads=8, check=True, check_state_every=1)
    seen["shard"] = (engine.config.cache.shape.num_kv_heads, engine.config.num_q_heads, engine.tp_size, engine.rank)
    if rank == 1:
        for call in (
            lambda: engine.add_request("x", 40, max_new_tokens=2),
            lambda: engine.cancel("x"),
            lambda: engine.step(payload="mine"),
        ):
            try:
                call()
            except mixkv.InvalidArgument as error:
                seen.setdefault("follower", []).append(str(error))
    else:
        try:
            engine.step(payload=lambda: None)
        except mixkv.InvalidArgument as error:
            seen["payload"] = (str(error), engine.steps)
        engine.add_request("a", 40, max_new_tokens=3)
        try:  # a plan of the wrong shape: rank 0 spends an internal id on it, the followers never see it
            engine.add_request("b", 100, plan=mixkv.PrecisionPlan(2, 5), max_new_tokens=3)
        except mixkv.InvalidArgument as error:
            seen["plan"] = str(error)
        engine.add_request("c", 70, max_new_tokens=4)
    digests, payloads, rows = [], [], []
    while engine.has_unfinished():
        # Step 2's payload does not fit the broadcast's buffer: it takes the second broadcast.
        payload = {"step": engine.steps + 1, "pad": "x" * (5000 if engine.steps == 1 else 0)}
        step = engine.step(payload=payload if rank == 0 else None)
        payloads.append(engine.payload)
        digests.append(engine.step_digest())
        rows.append(step.prefill_rows)
        if rank == 0 and engine.steps == 2:
            engine.fork("c", "c2")
            engine.finish("a")
        if step.prefill_rows:  # the K/V of this rank's 2 heads
            k = np.zeros((step.prefill_rows, 2, 64), np.float16)
            for layer in range(2):
                engine.store(layer, k, k)
    engine.verify_identical()
    seen.update(
        digests=digests, payloads=payloads, rows=rows, state=engine.describe_state(), stats=engine.stats().forks
    )
    return seen


@needs_torch
def test_calls_enter_on_rank_0_and_configs_must_agree():
    _, launch = _example()
    results = launch.launch(_api_rank, 2, timeout=DEADLINE, collective_timeout=COLLECTIVE_TIMEOUT)
    zero, one = _ok(results)
    for seen in (zero, one):
        assert "cache_config.shape.num_kv_heads = 3: expected a multiple of tp = 2" in seen["heads"]
        assert "rank 1's configuration differs from rank 0's in cache_config" in seen["config"]
        assert seen["shard"][:3] == (2, 4, 2)
        assert seen["stages"] == (4, 1, 2)
        assert "tp = 3: expected a divisor of the group's size 2" in seen["tp"]
    assert [s["shard"][3] for s in (zero, one)] == [0, 1]
    assert len(one["follower"]) == 3
    for message in one["follower"][:2]:
        assert "called on rank 1: requests, forks, finishes and cancels enter on rank 0" in message
    assert "payload: given on rank 1" in one["follower"][2]
    assert zero["payload"][0].startswith("TPEngine.step: payload: cannot be pickled") and zero["payload"][1] == 0
    assert "plan" in zero["plan"]
    # The same steps on both ranks, internal ids included, and rank 0's payloads everywhere.
    assert zero["digests"] == one["digests"] and len(zero["digests"]) >= 4
    expected = [{"step": i + 1, "pad": "x" * (5000 if i == 1 else 0)} for i in range(len(zero["digests"]))]
    assert zero["payloads"] == one["payloads"] == expected
    assert zero["state"] == one["state"] and zero["stats"] == one["stats"] == 1
    assert zero["rows"][0] == 110  # "a" and "c" prefilled together in step 1


@needs_torch
def test_run_example_command():
    """examples/tp/run.py as a user runs it: two ranks, then tp = 1 to compare."""
    result = subprocess.run(
        [
            sys.executable,
            str(EXAMPLE / "run.py"),
            "--tp",
            "2",
            "--plan",
            "int4",
            "--requests",
            "2",
            "--new-tokens",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=DEADLINE,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr
    assert "every rank's describe_state() equal: True" in result.stdout
    assert "against tp = 1: 8/8 tokens equal" in result.stdout


# -- two GPUs over NCCL ---------------------------------------------------------------------------------------------
def _gpus() -> int:
    if not HAS_TORCH or not mixkv.built_with_cuda:
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@needs_torch
@pytest.mark.skipif(_gpus() < 2, reason="needs 2 CUDA GPUs (and mixkv built with CUDA)")
@pytest.mark.parametrize("plan", ["fp16", "int4", "int2", "mixed"])
def test_two_gpus_over_nccl_equal_the_single_gpu_run(plan):
    """The CPU test's run on the CUDA backend: NCCL all-reduces of the model,
    the engine's messages over a gloo group beside it."""
    run, _ = _example()
    options = run.Options(plan=plan, backend="cuda")
    ranks = _ok(_launch(options, dist_backend="nccl"))
    _assert_equals_single_rank(ranks, run.run_single(options, like_tp=2), options.plan, exact_tokens=False)


@needs_torch
@pytest.mark.skipif(_gpus() < 2, reason="needs 2 CUDA GPUs (and mixkv built with CUDA)")
def test_two_gpus_under_memory_pressure():
    run, _ = _example()
    options = _pressure(run, preemption="swap", backend="cuda")
    ranks = _ok(_launch(options, dist_backend="nccl"))
    _assert_equals_single_rank(ranks, run.run_single(options, like_tp=2), options.plan, exact_tokens=False)
    assert ranks[0].stats["preempted_swap"] > 0 and ranks[0].stats["demotions"] > 0


@needs_torch
@pytest.mark.skipif(_gpus() < 2, reason="needs 2 CUDA GPUs (and mixkv built with CUDA)")
def test_two_gpus_rank_failure_stops_the_group():
    run, _ = _example()
    results = _launch(replace(run.Options(backend="cuda"), fault=(1, 2, "step")), dist_backend="nccl")
    for r in results:
        assert r.status == "error" and "step 2: rank 1 raised RuntimeError" in r.error, (r.rank, r.error)
