"""Starts a function on tp local ranks of torch.distributed and collects what
each returns or raises, with a deadline: a rank that hangs is terminated and
reported, never waited for.

    results = launch(fn, tp=2, args=options, timeout=60, dist_backend="gloo")
    for r in results: r.rank, r.status ("ok", "error", "timeout" or "exited"), r.value or r.error

``fn(rank, tp, args)`` runs in a fresh process (multiprocessing's spawn, so
CUDA may be used) after ``torch.distributed.init_process_group``; ``fn``
must be importable by name (a module-level function). Ranks meet through a
file store in a temporary folder, so no port has to be free.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional


@dataclass
class RankResult:
    rank: int
    status: str  # "ok", "error" (fn raised), "timeout" (terminated at the deadline), "exited" (died silently)
    value: Any = None  # fn's return value when ok
    error: Optional[str] = None  # "<type>: <message>" when it raised
    trace: Optional[str] = None


def _entry(
    fn: Callable[[int, int, Any], Any],
    rank: int,
    tp: int,
    store: str,
    dist_backend: str,
    collective_timeout: float,
    threads: int,
    args: Any,
    results: Any,
) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    # One host: gloo's pairs over loopback unless the caller chose an interface.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        dist.init_process_group(
            dist_backend,
            init_method=f"file://{store}",
            rank=rank,
            world_size=tp,
            timeout=datetime.timedelta(seconds=collective_timeout),
        )
        value = fn(rank, tp, args)
        results.put(RankResult(rank, "ok", value=value))
    except BaseException as error:  # reported to the parent, which decides
        results.put(RankResult(rank, "error", error=f"{type(error).__name__}: {error}", trace=traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(
    fn: Callable[[int, int, Any], Any],
    tp: int,
    args: Any = None,
    *,
    timeout: float = 120.0,
    dist_backend: str = "gloo",
    collective_timeout: float = 30.0,
    threads: int = 1,
) -> list:
    """Runs ``fn(rank, tp, args)`` on ranks 0 .. tp-1; returns one
    RankResult per rank, in rank order, within ``timeout`` seconds plus the
    start-up. ``collective_timeout``: the process group's timeout (a rank
    left waiting on a dead peer raises after it). ``threads``: torch's
    threads per rank."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"launch: tp = {tp!r}: expected an int >= 1")
    if dist_backend not in ("gloo", "nccl"):
        raise ValueError(f"launch: dist_backend = {dist_backend!r}: expected 'gloo' or 'nccl'")
    if not timeout > 0:
        raise ValueError(f"launch: timeout = {timeout!r}: expected > 0")
    context = mp.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory(prefix="mixkv-tp-") as folder:
        store = os.path.join(folder, "store")
        processes = [
            context.Process(
                target=_entry,
                args=(fn, rank, tp, store, dist_backend, collective_timeout, threads, args, results),
                daemon=True,
            )
            for rank in range(tp)
        ]
        for p in processes:
            p.start()
        collected: dict = {}
        deadline = time.monotonic() + timeout
        while len(collected) < tp and time.monotonic() < deadline:
            try:
                result = results.get(timeout=0.2)
                collected[result.rank] = result
            except queue.Empty:
                # A rank that died without a word (killed, a crash in C++) is not waited for.
                if all(not p.is_alive() for p in processes) and results.empty():
                    break
        for rank, p in enumerate(processes):
            p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
            if p.is_alive():
                p.terminate()
                p.join(5)
                if rank not in collected:
                    collected[rank] = RankResult(rank, "timeout", error=f"rank {rank} still running after {timeout} s")
            elif rank not in collected:
                collected[rank] = RankResult(rank, "exited", error=f"rank {rank} exited with code {p.exitcode}")
    return [collected[rank] for rank in range(tp)]
