"""What the FlashInfer benchmarks (flashinfer_decode_bench.py,
flashinfer_prefill_bench.py) share: building their JIT modules ahead of
timing, and the timing itself (CUDA events around one launch after an L2
flush, the median of `reps` after three warm-ups)."""

from __future__ import annotations

import concurrent.futures
import os
import time


def is_built(spec) -> bool:
    try:
        return bool(spec.is_compiled)
    except Exception:
        return spec.jit_library_path.exists()


def build_modules(specs: dict) -> None:
    """Builds the JIT modules `specs` (name -> JitSpec) concurrently, one ninja each."""
    # 1.5 jobs a core over the modules: the CPUs stay busy while one module's
    # last sources finish, and memory stays bounded (a CUTLASS source takes GBs).
    jobs = max(2, (3 * (os.cpu_count() or 4)) // (2 * max(1, len(specs))))
    os.environ.setdefault("MAX_JOBS", str(jobs))
    print(f"flashinfer JIT: {len(specs)} modules, MAX_JOBS={os.environ['MAX_JOBS']} each", flush=True)

    def build(item):
        name, spec = item
        t0 = time.time()
        if is_built(spec):
            return name, "already built"
        spec.build(need_lock=True)
        return name, f"built in {time.time() - t0:.0f} s"

    with concurrent.futures.ThreadPoolExecutor(max(1, len(specs))) as ex:
        for name, what in ex.map(build, specs.items()):
            print(f"flashinfer JIT {name}: {what}", flush=True)


def announce(flashinfer, torch) -> None:
    print(
        f"flashinfer {flashinfer.__version__}, torch {torch.__version__}, "
        f"workspace {os.environ['FLASHINFER_WORKSPACE_BASE']}",
        flush=True,
    )


def compile_only(build) -> None:
    """--compile-only: runs `build` in a process group of its own (ninja and
    nvcc join it), so that the device script can end the group at its
    deadline."""
    os.setpgrp()
    t0 = time.time()
    build()
    print(f"flashinfer JIT: all built in {time.time() - t0:.0f} s", flush=True)


def median_us(torch, fn, reps: int, flush, sleep_cycles: int) -> float:
    """`sleep_cycles` of GPU sleep go before each timed launch: Python
    enqueues the launch while the GPU is busy, so the host's launch overhead
    is not timed (C++ pays ~5 us)."""
    start = torch.cuda.Event(enable_timing=True)
    stop = torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(reps + 3):
        flush()
        if hasattr(torch.cuda, "_sleep"):
            torch.cuda._sleep(sleep_cycles)
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(stop) * 1000.0)
    times.sort()
    return times[len(times) // 2]
