"""The CUDA backend through Python with torch tensors: the same workloads on a
mixkv.KVCache (CPU reference) and a mixkv.cuda.DeviceKVCache must store the
same bytes and attend to the same outputs. Skipped, saying why, without a
CUDA build of mixkv, torch or a GPU."""

import importlib.util
import pathlib

import mixkv
import numpy as np
import pytest
from helpers import P, layout, plan_of, random_kv, reference_decode, relative_error

if not mixkv.built_with_cuda:
    pytest.skip("mixkv was built without CUDA (MIXKV_CUDA=OFF): no GPU tests", allow_module_level=True)
torch = pytest.importorskip("torch", reason="the GPU tests use torch tensors; torch is not installed")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device visible to torch", allow_module_level=True)

import mixkv.cuda as mc  # noqa: E402

ops = mixkv.ops
SHAPE = mixkv.CacheShape(num_layers=2, num_kv_heads=4, head_dim=128, block_size=32)
LAYOUTS = [layout(("text", 1)), layout(("text", 33)), layout(("text", 9), ("visual", 97), ("text", 5))]
PLANS = [
    mixkv.PrecisionPlan(2, 0),
    mixkv.PrecisionPlan(2, 0),
    plan_of([[P.FP16, P.INT4, P.INT2], [P.FP16, P.INT2, P.INT2]]),
]


def cuda(array):
    return torch.from_numpy(np.ascontiguousarray(array)).cuda()


def config():
    return mixkv.CacheConfig(SHAPE, 32 << 20, 2 << 20)


def pair(rng, layouts=LAYOUTS, plans=PLANS):
    """The same sequences stored in a host and a device cache; returns both and the K/V."""
    host, device = mixkv.KVCache(config()), mc.DeviceKVCache(config())
    mapping = mc.DeviceStoreMapping()
    kv = []
    for i, (lay, plan) in enumerate(zip(layouts, plans)):
        host.add_sequence(i, lay, plan)
        device.add_sequence(i, lay, plan)
        kv.append([])
        for layer in range(SHAPE.num_layers):
            k, v = random_kv(rng, lay.num_tokens, SHAPE.num_kv_heads, SHAPE.head_dim, 2.0, 0.7)
            ops.store_prefill(host, k, v, host.prefill_mapping(i, layer))
            mapping.upload(device.prefill_mapping(i, layer), SHAPE.block_size)
            ops.store_prefill(device, cuda(k), cuda(v), mapping)
            kv[-1].append((k, v))
    return host, device, kv


def device_arena(device):
    torch.cuda.synchronize()
    return torch.as_tensor(device.arena, device="cuda").cpu().numpy()


def used_blocks_equal(host, device, ids):
    """Every block the sequences hold has the same bytes in both arenas."""
    arena = device_arena(device)
    base = host.arena.ctypes.data
    for i in ids:
        for layer in range(SHAPE.num_layers):
            for p in P:
                for block_id in host.blocks(i, layer, p):
                    block = host.block(p, int(block_id))
                    offset = block.ctypes.data - base
                    if not np.array_equal(block, arena[offset : offset + block.size]):
                        return False
    return True


def decode_plan(device, ids, q_heads):
    tables = mc.DevicePageTables(mc.PageTableConfig(SHAPE.num_layers, max_sequences=8, max_blocks_per_sequence=64))
    for slot, i in enumerate(ids):
        tables.sync(slot, device, i)
    tables.upload()
    plan = mc.DecodePlan(
        mc.DecodePlanConfig(
            SHAPE.num_layers, q_heads, SHAPE.num_kv_heads, SHAPE.head_dim, SHAPE.block_size, max_batch=8
        ),
        tables,
    )
    plan.plan(list(range(len(ids))))
    return plan


def test_store_prefill_is_bit_identical_to_the_cpu_backend(rng):
    host, device, _ = pair(rng)
    assert used_blocks_equal(host, device, range(3))


@pytest.mark.parametrize("q_heads", [4, 28, 64])
def test_paged_decode_attention_matches_the_cpu_reference(rng, q_heads):
    host, device, _ = pair(rng)
    plan = decode_plan(device, [0, 1, 2], q_heads)
    q = rng.standard_normal((3, q_heads, SHAPE.head_dim)).astype(np.float16)
    md = host.decode_metadata([0, 1, 2])
    for layer in range(SHAPE.num_layers):
        out = torch.empty((3, q_heads, SHAPE.head_dim), dtype=torch.float16, device="cuda")
        lse = torch.empty((3, q_heads), dtype=torch.float32, device="cuda")
        ops.paged_decode_attention(device, plan, layer, cuda(q), out=out, lse=lse)
        want_out, want_lse = reference_decode(host, md, layer, q, 1 / np.sqrt(SHAPE.head_dim))
        torch.cuda.synchronize()
        assert relative_error(out.float().cpu().numpy(), want_out) < 5e-3
        # The C++ device tests' bound: 1e-3 relative to |lse| (scores use FP16 q with K scales folded in).
        assert (np.abs(lse.cpu().numpy() - want_lse) <= 1e-3 * np.maximum(1.0, np.abs(want_lse))).all()


def test_fp16_decode_matches_torch_sdpa(rng):
    """The dense baseline: SDPA on the same K/V as contiguous tensors."""
    lays = [layout(("text", 200))] * 2
    host, device, kv = pair(rng, lays, [mixkv.PrecisionPlan(2, 0)] * 2)
    plan = decode_plan(device, [0, 1], 28)
    q = torch.randn((2, 28, SHAPE.head_dim), dtype=torch.float16, device="cuda")
    out = torch.empty_like(q)
    ops.paged_decode_attention(device, plan, 0, q, out=out)
    k = torch.stack([cuda(kv[i][0][0]) for i in range(2)]).transpose(1, 2)  # [batch, kv_heads, tokens, dim]
    v = torch.stack([cuda(kv[i][0][1]) for i in range(2)]).transpose(1, 2)
    dense = torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)[:, :, 0]
    assert (out.float() - dense.float()).abs().max().item() < 5e-3 * dense.abs().max().item() + 1e-3


def test_append_and_copy_blocks_match_the_cpu_backend(rng):
    host, device, _ = pair(rng, LAYOUTS[:2], PLANS[:2])
    for cache in (host, device):
        cache.fork(1, 5)
    results = [cache.append_tokens([0, 5]) for cache in (host, device)]
    assert results[0].slots.tolist() == results[1].slots.tolist()
    copies = results[0].copies
    ops.copy_blocks(host, copies)
    ops.copy_blocks(device, cuda(np.array([[c.src, c.dst] for c in copies], np.int32).reshape(-1, 2)))
    slots = cuda(results[1].slots)
    for layer in range(SHAPE.num_layers):
        k, v = random_kv(rng, 2, SHAPE.num_kv_heads, SHAPE.head_dim)
        ops.append(host, k, v, results[0].slots[layer])
        ops.append(device, cuda(k), cuda(v), slots[layer])
    assert used_blocks_equal(host, device, [0, 1, 5])


def test_demote_matches_the_cpu_backend(rng):
    cfg = mixkv.CacheConfig(SHAPE, 32 << 20, 2 << 20, fp16_windows_first=True)
    host, device = mixkv.KVCache(cfg), mc.DeviceKVCache(cfg)
    lay = layout(("text", 3), ("visual", 96))
    mapping = mc.DeviceStoreMapping()
    for cache in (host, device):
        cache.add_sequence(1, lay, plan_of([[P.FP16, P.FP16, P.INT4]] * 2))
    for layer in range(2):
        k, v = random_kv(rng, lay.num_tokens, SHAPE.num_kv_heads, SHAPE.head_dim)
        ops.store_prefill(host, k, v, host.prefill_mapping(1, layer))
        mapping.upload(device.prefill_mapping(1, layer), SHAPE.block_size)
        ops.store_prefill(device, cuda(k), cuda(v), mapping)
    demotions = [mixkv.Demotion(1, 0, 1, P.INT2), mixkv.Demotion(1, 1, 2, P.INT2)]
    host_ops = host.demote(demotions)
    device_ops = device.demote(demotions)
    ops.demote(host, host_ops)
    for src, dst in ((P.FP16, P.INT2), (P.INT4, P.INT2)):
        moves = [[d.src_block, d.dst_block] for d in device_ops if (d.src_precision, d.dst_precision) == (src, dst)]
        ops.demote(device, cuda(np.array(moves, np.int32)), src, dst)
    assert used_blocks_equal(host, device, [1])


def test_swap_out_and_in_match_the_cpu_backend(rng):
    cfg = mixkv.CacheConfig(SHAPE, 32 << 20, 2 << 20, swap_blocks=[64, 16, 16])
    host, device = mixkv.KVCache(cfg), mc.DeviceKVCache(cfg)
    assert device.swap is not None and device.swap.nbytes == device.swap_bytes()
    mapping = mc.DeviceStoreMapping()
    for i, (lay, plan) in enumerate(zip(LAYOUTS, PLANS)):
        for cache in (host, device):
            cache.add_sequence(i, lay, plan)
        for layer in range(SHAPE.num_layers):
            k, v = random_kv(rng, lay.num_tokens, SHAPE.num_kv_heads, SHAPE.head_dim)
            ops.store_prefill(host, k, v, host.prefill_mapping(i, layer))
            mapping.upload(device.prefill_mapping(i, layer), SHAPE.block_size)
            ops.store_prefill(device, cuda(k), cuda(v), mapping)
    stream = torch.cuda.Stream()
    copies = [cache.swap_out(2) for cache in (host, device)]
    assert [(c.pool, c.device_block, c.host_slot) for c in copies[0]] == [
        (c.pool, c.device_block, c.host_slot) for c in copies[1]
    ]
    ops.swap_blocks(host, copies[0], ops.SwapDirection.DeviceToHost)
    ops.swap_blocks(device, copies[1], ops.SwapDirection.DeviceToHost, stream=stream)
    stream.synchronize()
    assert np.array_equal(device.swap, host.swap)
    # The released blocks are taken and overwritten by a new sequence.
    for cache in (host, device):
        cache.add_sequence(7, LAYOUTS[2], PLANS[2])
    for layer in range(SHAPE.num_layers):
        k, v = random_kv(rng, LAYOUTS[2].num_tokens, SHAPE.num_kv_heads, SHAPE.head_dim)
        mapping.upload(device.prefill_mapping(7, layer), SHAPE.block_size)
        ops.store_prefill(device, cuda(k), cuda(v), mapping)
        ops.store_prefill(host, k, v, host.prefill_mapping(7, layer))
    copies = [cache.swap_in(2) for cache in (host, device)]
    ops.swap_blocks(host, copies[0], ops.SwapDirection.HostToDevice)
    ops.swap_blocks(device, copies[1], ops.SwapDirection.HostToDevice)
    assert used_blocks_equal(host, device, [0, 1, 2, 7])
    with pytest.raises(IndexError, match=r"copies\[0\].host_slot"):
        ops.swap_blocks(device, [mixkv.SwapCopy(P.FP16, 0, 64)], ops.SwapDirection.HostToDevice)
    with pytest.raises(ValueError, match="swap pool"):
        ops.swap_blocks(mc.DeviceKVCache(config()), [], ops.SwapDirection.HostToDevice)


def test_merge_states_matches_the_cpu_backend(rng):
    out_a, out_b = (rng.standard_normal((17, 128)).astype(np.float32) for _ in range(2))
    lse_a, lse_b = (rng.standard_normal(17).astype(np.float32) for _ in range(2))
    lse_a[3] = lse_b[3] = -np.inf
    want_out, want_lse = ops.merge_states(out_a, lse_a, out_b, lse_b)
    out, lse = torch.empty((17, 128), device="cuda"), torch.empty(17, device="cuda")
    ops.merge_states(cuda(out_a), cuda(lse_a), cuda(out_b), cuda(lse_b), out=out, lse=lse)
    torch.cuda.synchronize()
    assert np.allclose(out.cpu().numpy(), want_out, atol=1e-5)
    assert np.allclose(lse.cpu().numpy(), want_lse, atol=1e-5)
    assert not torch.isnan(out).any()


def test_work_runs_on_the_callers_stream(rng):
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        host, device, _ = pair(rng, LAYOUTS[1:2], PLANS[1:2])
        plan = decode_plan(device, [0], 8)
        q = torch.randn((1, 8, SHAPE.head_dim), dtype=torch.float16, device="cuda")
        out = torch.zeros_like(q)
        ops.paged_decode_attention(device, plan, 1, q, out=out)
    stream.synchronize()
    want, _ = reference_decode(host, host.decode_metadata([0]), 1, q.cpu().numpy(), 1 / np.sqrt(SHAPE.head_dim))
    assert relative_error(out.float().cpu().numpy(), want) < 5e-3
    # An explicit stream works too: an int or the torch stream object.
    ops.paged_decode_attention(device, plan, 1, q, out=out, stream=stream.cuda_stream)
    ops.paged_decode_attention(device, plan, 1, q, out=out, stream=stream)
    stream.synchronize()


def test_cuda_planner_matches_the_cpu_planner(rng):
    config = mixkv.PlannerConfig(sensitivities=[0.9, 0.4], window_size=32)
    lay = layout(("text", 9), ("visual", 133), ("text", 7))
    embeddings = [rng.standard_normal((lay.num_tokens, 64)).astype(np.float32) for _ in range(2)]
    want = mixkv.WindowPlanner(config).plan([lay, lay], embeddings)
    got = mc.CudaWindowPlanner(config).plan([lay, lay], [cuda(e) for e in embeddings])
    for g, w in zip(got, want):
        assert [[g.at(layer, i) for i in range(g.num_windows)] for layer in range(2)] == [
            [w.at(layer, i) for i in range(w.num_windows)] for layer in range(2)
        ]
    bf16 = [cuda(e).to(torch.bfloat16) for e in embeddings]
    assert len(mc.CudaWindowPlanner(config).plan([lay, lay], bf16)) == 2


def test_bad_cuda_arrays_name_the_argument(rng):
    _, device, _ = pair(rng, LAYOUTS[:1], PLANS[:1])
    mapping = mc.DeviceStoreMapping()
    mapping.upload(device.prefill_mapping(0, 0), SHAPE.block_size)
    assert mapping.rows == 1
    k, v = random_kv(rng, 1, SHAPE.num_kv_heads, SHAPE.head_dim)
    with pytest.raises(ValueError, match="k: expected a CUDA float16 array .* got numpy.ndarray in host memory"):
        ops.store_prefill(device, k, cuda(v), mapping)
    with pytest.raises(ValueError, match="k: expected a CUDA float16 array"):
        ops.store_prefill(device, torch.from_numpy(k), cuda(v), mapping)
    with pytest.raises(ValueError, match="v: expected dtype float16, got typestr '<f4'"):
        ops.store_prefill(device, cuda(k), cuda(v).float(), mapping)
    with pytest.raises(ValueError, match=r"k: expected shape \(mapping.rows=1, num_kv_heads=4, head_dim=128\)"):
        ops.store_prefill(device, cuda(k)[:, :2], cuda(v), mapping)
    with pytest.raises(ValueError, match="k: expected a C-contiguous array"):
        ops.store_prefill(device, cuda(np.zeros((128, 4, 1), np.float16)).permute(2, 1, 0), cuda(v), mapping)
    with pytest.raises(ValueError, match="requires grad"):
        ops.store_prefill(device, cuda(k).float().requires_grad_().half(), cuda(v), mapping)
    plan = decode_plan(device, [0], 8)
    q = torch.randn((1, 8, SHAPE.head_dim), dtype=torch.float16, device="cuda")
    with pytest.raises(ValueError, match="out: expected shape"):
        ops.paged_decode_attention(device, plan, 0, q, out=torch.empty((1, 8, 64), dtype=torch.float16, device="cuda"))
    with pytest.raises(IndexError, match="layer = 2"):
        ops.paged_decode_attention(device, plan, 2, q, out=torch.empty_like(q))
    with pytest.raises(ValueError, match="stream: expected"):
        ops.paged_decode_attention(device, plan, 0, q, out=torch.empty_like(q), stream="default")
    with pytest.raises(ValueError, match="out, lse: expected CUDA float32 arrays"):
        ops.merge_states(
            torch.zeros((2, 8), device="cuda"),
            torch.zeros(2, device="cuda"),
            torch.zeros((2, 8), device="cuda"),
            torch.zeros(2, device="cuda"),
        )
    with pytest.raises(ValueError, match="Unsupported head_dim"):
        mc.DecodePlan(mc.DecodePlanConfig(2, 4, 4, 96, 32, 8), mc.DevicePageTables(mc.PageTableConfig(2, 8, 8)))
    with pytest.raises(ValueError, match="max_heads_per_item = 12: expected 0, 8 or 16"):
        mc.DecodePlan(
            mc.DecodePlanConfig(2, 4, 4, 128, 32, 8, max_heads_per_item=12),
            mc.DevicePageTables(mc.PageTableConfig(2, 8, 8)),
        )


def load_llama_decode_example():
    path = pathlib.Path(__file__).resolve().parents[2] / "examples" / "llama_decode.py"
    spec = importlib.util.spec_from_file_location("llama_decode", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "fp16_only, workload, preemption",
    [
        (False, (12, 2, 48), mixkv.PreemptionMode.Swap),  # WindowQuant plans, applied by demotion
        (True, (16, 1, 80), mixkv.PreemptionMode.Swap),  # FP16 floors: swapped out and in instead
        (True, (16, 1, 80), mixkv.PreemptionMode.Recompute),  # freed and prefilled again
    ],
    ids=["demotions", "swaps", "recomputes"],
)
def test_scheduler_driven_engine_matches_the_cpu_backend(fp16_only, workload, preemption):
    """examples/llama_decode.py's engine loop (a mixkv.Engine: the scheduler deciding, the backend applying
    demotions, swaps, preemptions and page tables, prompts prefilled through the cache) on the CUDA backend
    against the same loop on the CPU backend, in a 1 MiB arena that forces the memory moves. The GPU run is fed the CPU run's tokens, so both
    see the same sequences: the scheduler must make the same decisions and every logit must agree."""
    example = load_llama_decode_example()
    requests_count, frames, new_tokens = workload
    runs = []
    for backend in ("cpu", "cuda"):
        rng = np.random.default_rng(7)
        model = example.Model(rng)
        requests = example.make_requests(rng, model, requests_count, frames, new_tokens)
        forced = runs[0]["generated"] if runs else None
        runs.append(
            example.serve(
                model,
                requests,
                [0.85] * example.LAYERS,
                fp16_only,
                1 << 20,
                backend,
                swap_blocks=64,
                preemption=preemption,
                forced=forced,
            )
        )
    host, device = runs
    moves = {
        "demotions": host["demotions"] + host["plan_demotions"],
        "swaps": host["preempted_swap"],
        "recomputes": host["preempted_recompute"],
    }
    expected = "demotions" if not fp16_only else ("swaps" if preemption == mixkv.PreemptionMode.Swap else "recomputes")
    assert moves[expected] > 0, f"the arena forced no {expected}: {moves}"
    for key in (
        "demotions",
        "plan_demotions",
        "preempted_swap",
        "preempted_recompute",
        "peak",
        "decode_tokens",
        "prefill_tokens",
    ):
        assert device[key] == host[key], key
    worst = 0.0
    for rid, logits in host["logits"].items():
        assert len(device["logits"][rid]) == len(logits) == new_tokens
        for a, b in zip(logits, device["logits"][rid]):
            worst = max(worst, float(np.abs(a - b).max()) / max(1.0, float(np.abs(a).max())))
    # The GPU's attention output is FP16 where the CPU backend returns float32 of a float64 sum.
    assert worst <= 2e-2, f"largest logit difference {worst:.3g} (relative to the row's largest logit)"


def test_a_decode_step_captured_in_a_cuda_graph_replays_for_smaller_batches(rng):
    """An engine captures its decode step (every layer's append and attention, fixed_grid=True) once, at its
    largest batch, and replays it each step: plan() is redone outside the graph, the batch's rows go into the
    static buffers and the rows past it get slot -1 in append (nothing written; they hold NaNs here). Each replay
    must append and attend exactly as eager calls on the CPU backend do."""
    host, device, _ = pair(rng)
    ids, q_heads, dim, kv_heads = [0, 1, 2], 28, SHAPE.head_dim, SHAPE.num_kv_heads
    layers, batch = SHAPE.num_layers, len(ids)
    tables = mc.DevicePageTables(mc.PageTableConfig(layers, max_sequences=8, max_blocks_per_sequence=64))
    plan = mc.DecodePlan(mc.DecodePlanConfig(layers, q_heads, kv_heads, dim, SHAPE.block_size, max_batch=batch), tables)
    for i in ids:  # page-table slot = sequence id
        tables.sync(i, device, i)
    tables.upload()
    plan.plan(ids)
    static_q = torch.zeros((layers, batch, q_heads, dim), dtype=torch.float16, device="cuda")
    static_k = torch.zeros((layers, batch, kv_heads, dim), dtype=torch.float16, device="cuda")
    static_v = torch.zeros_like(static_k)
    static_slots = torch.full((layers, batch), -1, dtype=torch.int32, device="cuda")
    static_out = torch.zeros_like(static_q)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in range(layers):
            ops.append(device, static_k[layer], static_v[layer], static_slots[layer])
            ops.paged_decode_attention(device, plan, layer, static_q[layer], out=static_out[layer], fixed_grid=True)

    scale = 1 / np.sqrt(dim)
    for step_ids in ([2, 0], [0, 1, 2], [1]):
        results = [cache.append_tokens(step_ids) for cache in (host, device)]
        assert results[0].slots.tolist() == results[1].slots.tolist()
        for i in step_ids:
            tables.sync(i, device, i)
        tables.upload()
        plan.plan(step_ids)
        n = len(step_ids)
        q = rng.standard_normal((layers, n, q_heads, dim)).astype(np.float16)
        k, v = (rng.standard_normal((layers, n, kv_heads, dim)).astype(np.float16) for _ in range(2))
        static_q[:, :n], static_k[:, :n], static_v[:, :n] = cuda(q), cuda(k), cuda(v)
        static_k[:, n:], static_v[:, n:] = float("nan"), float("nan")
        static_slots.fill_(-1)
        static_slots[:, :n] = cuda(results[1].slots)
        graph.replay()
        md = host.decode_metadata(step_ids)
        for layer in range(layers):
            ops.append(host, k[layer], v[layer], results[0].slots[layer])
            want, _ = reference_decode(host, md, layer, q[layer], scale)
            torch.cuda.synchronize()
            assert relative_error(static_out[layer, :n].float().cpu().numpy(), want) < 5e-3, (step_ids, layer)
        assert used_blocks_equal(host, device, ids), step_ids


# ---- ids out of range (issue: memory safety of the CUDA ops) ----

FP16_BLOCK_BYTES = SHAPE.num_kv_heads * SHAPE.head_dim * SHAPE.block_size * 2 * 2


def fp16_blocks(cfg):
    """Ids in [0, this) address the arena through the FP16 pool's view."""
    return (cfg.arena_bytes // cfg.slab_bytes) * (cfg.slab_bytes // FP16_BLOCK_BYTES)


def int32_cuda(rows):
    return cuda(np.array(rows, np.int64).astype(np.int32))


def test_append_out_of_range_slots_are_skipped_and_raised(rng):
    """One past the pool, far past it and negative: the kernel skips the row, the next op (or
    check_status) raises IndexError naming it; the other row lands; the context survives."""
    host, device, _ = pair(rng, LAYOUTS[:2], PLANS[:2])
    limit = fp16_blocks(config()) * SHAPE.block_size
    for bad in [limit, limit + 1, 2**30, 2**31 - 1, -2, -(2**31)]:
        host_result = host.append_tokens([0])
        device_result = device.append_tokens([0])
        slots = device_result.slots[0].tolist() + [bad]
        k, v = random_kv(rng, 2, SHAPE.num_kv_heads, SHAPE.head_dim)
        ops.append(host, k[:1], v[:1], host_result.slots[0])
        ops.append(device, cuda(k), cuda(v), int32_cuda(slots))
        with pytest.raises(IndexError, match=rf"append: fp16_slots\[1\] = {bad}: expected a slot in \[0, {limit}\)"):
            device.check_status()
        device.check_status()  # reported once
        for layer in range(1, SHAPE.num_layers):
            k, v = random_kv(rng, 1, SHAPE.num_kv_heads, SHAPE.head_dim)
            ops.append(host, k, v, host_result.slots[layer])
            ops.append(device, cuda(k), cuda(v), cuda(device_result.slots[layer]))
        assert used_blocks_equal(host, device, [0, 1])
    # Raised by the next op too, before it runs.
    k, v = random_kv(rng, 1, SHAPE.num_kv_heads, SHAPE.head_dim)
    ops.append(device, cuda(k), cuda(v), int32_cuda([limit]))
    torch.cuda.synchronize()
    with pytest.raises(IndexError, match=r"fp16_slots\[0\]"):
        ops.copy_blocks(device, int32_cuda(np.zeros((0, 2))))
    device.check_status()
    assert used_blocks_equal(host, device, [0, 1])


@pytest.mark.parametrize("column", [0, 1])
def test_copy_blocks_and_demote_out_of_range_ids_are_skipped_and_raised(rng, column):
    host, device, _ = pair(rng)
    before = device_arena(device)
    limit = fp16_blocks(config())
    for bad in [limit, limit + 1, 2**30, 2**31 - 1, -1, -(2**31)]:
        row = [0, 0]
        row[column] = bad
        ops.copy_blocks(device, int32_cuda([row]))
        with pytest.raises(IndexError, match=rf"copy_blocks: copies\[0\]\.{'dst' if column else 'src'} = {bad}"):
            device.check_status()
        if column == 0:
            ops.demote(device, int32_cuda([[bad, 0]]), P.FP16, P.INT4)
            with pytest.raises(
                IndexError, match=rf"demote: moves\[0\]\.src = {bad}: expected a block id in \[0, {limit}\)"
            ):
                device.check_status()
        elif bad < 0 or bad >= 2**30:
            ops.demote(device, int32_cuda([[0, bad]]), P.FP16, P.INT2)
            with pytest.raises(IndexError, match=rf"demote: moves\[0\]\.dst = {bad}"):
                device.check_status()
    assert np.array_equal(device_arena(device), before), "a skipped copy or move wrote the arena"
    # The context still works: a decode over the untouched cache matches the CPU.
    plan = decode_plan(device, [0, 1, 2], 28)
    q = rng.standard_normal((3, 28, SHAPE.head_dim)).astype(np.float16)
    out = torch.empty((3, 28, SHAPE.head_dim), dtype=torch.float16, device="cuda")
    ops.paged_decode_attention(device, plan, 0, cuda(q), out=out)
    want, _ = reference_decode(host, host.decode_metadata([0, 1, 2]), 0, q, 1 / np.sqrt(SHAPE.head_dim))
    torch.cuda.synchronize()
    assert relative_error(out.float().cpu().numpy(), want) < 5e-3


def test_store_mappings_and_page_tables_are_checked_on_the_host(rng):
    host, device, _ = pair(rng, LAYOUTS[:1], PLANS[:1])
    before = device_arena(device)
    limit = fp16_blocks(config())
    good = device.prefill_mapping(0, 0)
    mapping = mc.DeviceStoreMapping()
    for bad in [limit * SHAPE.block_size, 2**30]:
        m = device.prefill_mapping(0, 0)
        m.fp16_slots = [bad] + m.fp16_slots.tolist()[1:]
        with pytest.raises(IndexError, match=r"mapping\.fp16_slots\[0\]"):
            mapping.upload(m, SHAPE.block_size, cache=device)
        # Uploaded without the cache: store_prefill refuses before launching.
        mapping.upload(m, SHAPE.block_size)
        k, v = random_kv(rng, len(good.fp16_slots), SHAPE.num_kv_heads, SHAPE.head_dim)
        with pytest.raises(IndexError, match=r"store_prefill: max_block_ids\[FP16\]"):
            ops.store_prefill(device, cuda(k), cuda(v), mapping)
    with pytest.raises(ValueError, match=r"fp16_slots\[0\] = -2"):
        m = device.prefill_mapping(0, 0)
        m.fp16_slots = [-2] + m.fp16_slots.tolist()[1:]
        mapping.upload(m, SHAPE.block_size, cache=device)

    config_ = mc.PageTableConfig(SHAPE.num_layers, max_sequences=2, max_blocks_per_sequence=8)
    with pytest.raises(ValueError, match="no pool bound"):
        mc.DevicePageTables(config_).set_blocks(0, 0, P.FP16, [0], 1)
    tables = mc.DevicePageTables(config_, cache=device)
    assert tables.config.pool_blocks[0] == limit
    for bad in [limit, limit + 1, 2**30, -1]:
        with pytest.raises(IndexError, match=rf"blocks\[1\] = {bad}: expected a block id in \[0, {limit}\)"):
            tables.set_blocks(0, 0, P.FP16, [0, bad], 1)
    assert tables.pending_updates() == 0
    # Tables bound by sync() from the cache; a decode still works on this context.
    plan = decode_plan(device, [0], 28)
    q = torch.randn((1, 28, SHAPE.head_dim), dtype=torch.float16, device="cuda")
    out = torch.empty_like(q)
    ops.paged_decode_attention(device, plan, 0, q, out=out)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    assert np.array_equal(device_arena(device), before)


def test_decode_rejects_overlapping_out_and_lse(rng):
    _, device, _ = pair(rng, LAYOUTS[:1], PLANS[:1])
    plan = decode_plan(device, [0], 4)
    q = torch.randn((1, 4, SHAPE.head_dim), dtype=torch.float16, device="cuda")
    buffer = torch.empty(4 * SHAPE.head_dim * 2, dtype=torch.float16, device="cuda")
    out = buffer[: 4 * SHAPE.head_dim].view(1, 4, SHAPE.head_dim)
    lse = buffer.view(torch.float32)[:4].view(1, 4)
    with pytest.raises(ValueError, match="out overlaps lse"):
        ops.paged_decode_attention(device, plan, 0, q, out=out, lse=lse)


def test_cuda_configs_are_copies():
    cfg = mc.PageTableConfig(2, 4, 8)
    tables = mc.DevicePageTables(cfg)
    tables.config.max_sequences = 99
    assert tables.config.max_sequences == 4
    cfg.max_sequences = 77
    assert tables.config.max_sequences == 4
    plan = mc.DecodePlan(mc.DecodePlanConfig(2, 4, SHAPE.num_kv_heads, SHAPE.head_dim, SHAPE.block_size, 4), tables)
    plan.config.max_batch = 99
    assert plan.config.max_batch == 4
