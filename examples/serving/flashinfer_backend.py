"""FlashInfer (0.7.2.post1) as the serving loop's attention backend: its
paged prefill (BatchPrefillWithPagedKVCacheWrapper, FA2, causal) for prompt
chunks and its paged decode (BatchDecodeWithPagedKVCacheWrapper) for decode
rows, over paged.py's cache and scheduler, K/V float16 or float8 e4m3
(queries float16, scales 1). Each step plans both wrappers once (the host
page tables go up with the plan); each layer writes the rows' K/V into
their slots and runs the kernel.

compile_modules() builds the four JIT modules (prefill and decode, FP16 and
FP8 K/V, head_dim 64) ahead of time, concurrently: the device script runs it
while mixkv builds, so nothing compiles while anything is timed. FlashInfer's
JIT workspace is $FLASHINFER_WORKSPACE_BASE (default /tmp/fi-ws).
"""

from __future__ import annotations

import concurrent.futures
import os
import time

import torch
from paged import PagedKVBackend

os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", "/tmp/fi-ws")

# FlashInfer's JIT compiles against the DLPack header apache-tvm-ffi ships; an
# include path inherited from the caller (CPATH naming an older dlpack.h, as a
# mixkv build may use) would shadow it and every module would fail to compile.
for _var in ("CPATH", "CPLUS_INCLUDE_PATH", "C_INCLUDE_PATH"):
    os.environ.pop(_var, None)

HEAD_DIM = 64
KV_DTYPES = {"fp16": torch.float16, "fp8": torch.float8_e4m3fn}


def module_specs(kv_names=("fp16", "fp8"), head_dim: int = HEAD_DIM):
    """{name: JIT spec} of the modules the wrappers load for float16 queries and these K/V dtypes."""
    from flashinfer.jit.attention import modules as M

    specs = {}
    for name in kv_names:
        kv = KV_DTYPES[name]
        # q, kv, o, index dtypes, head dims, no RoPE, no sliding window, no soft cap (, no fp16 qk reduction)
        prefill_args = (torch.float16, kv, torch.float16, torch.int32, head_dim, head_dim, 0, False, False, False)
        # The prefill wrapper's fa2 path loads the "primary" (equal-stride) module where the version has it.
        gen = getattr(M, "_gen_batch_prefill_primary_module", None) or M.gen_batch_prefill_module
        specs[f"prefill_{name}"] = gen("fa2", *prefill_args)
        specs[f"decode_{name}"] = M.gen_batch_decode_module(
            torch.float16, kv, torch.float16, torch.int32, head_dim, head_dim, 0, False, False
        )
    return specs


def is_built(spec) -> bool:
    try:
        return bool(spec.is_compiled)
    except Exception:
        return spec.jit_library_path.exists()


def compile_modules(kv_names=("fp16", "fp8"), log=print):
    """Builds the modules not built yet, concurrently (one ninja each)."""
    specs = module_specs(kv_names)
    jobs = max(2, (3 * (os.cpu_count() or 4)) // (2 * max(1, len(specs))))
    os.environ.setdefault("MAX_JOBS", str(jobs))

    def build(item):
        name, spec = item
        if is_built(spec):
            return name, "already built"
        t0 = time.time()
        spec.build(need_lock=True)
        return name, f"built in {time.time() - t0:.0f} s"

    with concurrent.futures.ThreadPoolExecutor(max(1, len(specs))) as ex:
        for name, what in ex.map(build, specs.items()):
            log(f"flashinfer JIT {name}: {what}")


def unbuilt_modules(kv_names) -> list:
    return [name for name, spec in module_specs(kv_names).items() if not is_built(spec)]


class FlashInferBackend(PagedKVBackend):
    name = "flashinfer"

    def __init__(self, config, budget_bytes: int, device, *args, **kwargs):
        """PagedKVBackend's arguments; the device must be a CUDA one."""
        import flashinfer

        if torch.device(device).type != "cuda":
            raise ValueError(f"device {device}: FlashInfer needs a CUDA device")
        super().__init__(config, budget_bytes, device, *args, **kwargs)
        # A float workspace each (128 MiB, FlashInfer's recommendation): a wrapper's split-KV partials live there.
        self.workspaces = [torch.zeros(128 << 20, dtype=torch.uint8, device=self.device) for _ in range(2)]
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspaces[0], "NHD", backend="fa2")
        self.decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspaces[1], "NHD")
        self.version = flashinfer.__version__

    def plan_step(self, step):
        c = self.config
        common = dict(sm_scale=self.sm_scale, q_data_type=torch.float16, kv_data_type=self.kv_dtype)
        if self.chunks:
            indptr, indices, last = self.prefill_table
            self.prefill_wrapper.plan(
                torch.from_numpy(self.prefill_qo),
                torch.from_numpy(indptr),
                torch.from_numpy(indices),
                torch.from_numpy(last),
                c.num_heads,
                c.num_kv_heads,
                c.head_dim,
                self.page_size,
                causal=True,
                **common,
            )
        if self.decode_ids:
            indptr, indices, last = self.decode_table
            self.decode_wrapper.plan(
                torch.from_numpy(indptr),
                torch.from_numpy(indices),
                torch.from_numpy(last),
                c.num_heads,
                c.num_kv_heads,
                c.head_dim,
                self.page_size,
                **common,
            )

    def prefill_attention(self, layer: int, q):
        return self.prefill_wrapper.run(q, self.kv(layer))

    def decode_attention(self, layer: int, q, out):
        self.decode_wrapper.run(q, self.kv(layer), out=out)

    def describe(self) -> dict:
        d = super().describe()
        d["flashinfer"] = self.version
        d["decode_backend"] = str(
            getattr(self.decode_wrapper, "resolved_backend", getattr(self.decode_wrapper, "_backend", "?"))
        )
        return d

    def close(self):
        super().close()
        self.prefill_wrapper = self.decode_wrapper = self.workspaces = None


def main():
    import argparse

    ap = argparse.ArgumentParser(description="Build FlashInfer's JIT modules for the serving benchmark, and exit.")
    ap.add_argument("--kv", default="fp16,fp8", help="K/V dtypes: fp16 and/or fp8")
    args = ap.parse_args()
    kinds = [k for k in args.kv.split(",") if k]
    for k in kinds:
        if k not in KV_DTYPES:
            ap.error(f"--kv: unknown {k!r} (expected fp16, fp8)")
    # A process group of its own (ninja and nvcc join it): serving_on_device.sh ends the group at its deadline.
    os.setpgrp()
    import flashinfer

    t0 = time.time()
    print(f"flashinfer {flashinfer.__version__}: {len(module_specs(kinds))} JIT modules", flush=True)
    compile_modules(kinds, log=lambda m: print(m, flush=True))
    print(f"flashinfer JIT: all built in {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
