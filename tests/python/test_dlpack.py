"""Arrays into mixkv without copies (bindings/src/dlpack.h): DLPack first,
then __cuda_array_interface__, then the buffer protocol; the checks every
Engine argument gets, through mixkv._engine.tensor_info. torch and CuPy
cases skip, saying why, when the library (or a GPU) is missing."""

import array
import importlib.util

import mixkv
import numpy as np
import pytest
from mixkv import _engine

info = _engine.tensor_info


def address(a):
    return a.__array_interface__["data"][0]


@pytest.mark.parametrize("dtype", ["float16", "float32", "int32"])
def test_numpy_crosses_through_dlpack_without_a_copy(dtype):
    a = np.arange(24, dtype=dtype).reshape(2, 3, 4)
    got = info(a)
    assert got == {"protocol": "dlpack", "dtype": dtype, "device": "cpu", "shape": (2, 3, 4), "data": address(a)}


def test_views_keep_their_offset_and_the_array_stays_alive():
    a = np.arange(40, dtype=np.float16).reshape(10, 4)
    view = a[3:7]
    assert info(view)["data"] == address(a) + 3 * 4 * 2
    assert info(view)["shape"] == (4, 4)
    assert info(np.float32(1.5))["shape"] == ()  # 0-d


def test_read_only_arrays_cross_through_the_buffer_protocol():
    a = np.zeros((3, 4), np.float32)
    a.flags.writeable = False
    got = info(a)
    assert got["protocol"] in ("dlpack", "buffer") and got["data"] == address(a)
    with pytest.raises(mixkv.InvalidArgument, match=r"tensor_info: array: .*got a read-only array"):
        info(a, writable=True)


def test_buffer_protocol_objects():
    got = info(memoryview(array.array("f", [1.0, 2.0, 3.0])))
    assert got["protocol"] == "buffer" and got["dtype"] == "float32" and got["shape"] == (3,)
    with pytest.raises(mixkv.InvalidArgument, match=r"got buffer format 'd'"):
        info(memoryview(array.array("d", [1.0])))


def test_non_contiguous_arrays_are_refused():
    a = np.zeros((4, 6), np.float16)
    with pytest.raises(
        mixkv.InvalidArgument,
        match=r"tensor_info: array: expected a C-contiguous float16, bfloat16, float32 or int32 array "
        r"on cpu, got a non-contiguous array with strides \(1, 6\) elements",
    ):
        info(a.T)
    with pytest.raises(mixkv.InvalidArgument, match=r"non-contiguous array with strides \(12, 2\)"):
        info(a.reshape(2, 12)[:, ::2])
    assert info(a[:, None, :])["shape"] == (4, 1, 6)  # a size-1 axis may have any stride
    assert info(np.zeros((0, 3), np.float16)[:, ::2])["shape"] == (0, 2)  # nothing to misplace


@pytest.mark.parametrize(
    "dtype, name",
    [("float64", "float64"), ("int64", "int64"), ("uint8", "uint8"), ("complex64", "complex64"), ("bool", "")],
)
def test_wrong_dtypes_name_what_they_got(dtype, name):
    with pytest.raises(
        mixkv.InvalidArgument,
        match=rf"expected a C-contiguous float16, bfloat16, float32 or int32 "
        rf"array on cpu, got {name}",
    ):
        info(np.zeros(3, dtype))


def test_wrong_devices_and_non_arrays():
    with pytest.raises(mixkv.InvalidArgument, match=r"expected a C-contiguous .* array on cuda:0, got float16 on cpu"):
        info(np.zeros(3, np.float16), device="cuda")
    with pytest.raises(mixkv.InvalidArgument, match=r"got list \(no __dlpack__, __cuda_array_interface__ or buffer\)"):
        info([1.0, 2.0])
    with pytest.raises(mixkv.InvalidArgument, match=r"of at most 4 dimensions, got shape \(1, 1, 1, 1, 2\)"):
        info(np.zeros((1, 1, 1, 1, 2), np.float32))
    with pytest.raises(mixkv.InvalidArgument, match=r"tensor_info: device: expected 'cpu' or 'cuda'"):
        info(np.zeros(3, np.float16), device="tpu")


def test_a_producer_error_is_named():
    class Refuses:
        def __dlpack__(self, stream=None):
            raise RuntimeError("cannot export this one")

        def __dlpack_device__(self):
            return (1, 0)

    with pytest.raises(
        mixkv.InvalidArgument,
        match=r"tensor_info: array: __dlpack__\(\) of .*Refuses raised RuntimeError: cannot export this one$",
    ):
        info(Refuses())


def test_the_capsule_deleter_runs_once():
    """The consumer renames the capsule and calls the deleter: the array's
    reference from the capsule is dropped as soon as the call returns."""
    import sys

    a = np.zeros((5, 3), np.float16)
    before = sys.getrefcount(a)
    for _ in range(100):
        info(a)
    assert sys.getrefcount(a) == before


def torch_or_skip(cuda=False):
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    import torch

    if cuda and not torch.cuda.is_available():
        pytest.skip("no GPU visible to torch")
    if cuda and not mixkv.built_with_cuda:
        pytest.skip("mixkv was built without CUDA (MIXKV_CUDA=OFF)")
    return torch


def test_torch_cpu_tensors():
    torch = torch_or_skip()
    t = torch.arange(12, dtype=torch.float16).reshape(3, 4)
    got = info(t)
    assert got["protocol"] == "dlpack" and got["dtype"] == "float16" and got["data"] == t.data_ptr()
    assert info(t.to(torch.bfloat16))["dtype"] == "bfloat16"
    with pytest.raises(mixkv.InvalidArgument, match=r"non-contiguous"):
        info(t.t())
    with pytest.raises(mixkv.InvalidArgument, match=r"tensor_info: array: .*(grad|gradient)"):
        info(torch.zeros(3, requires_grad=True))


def test_dlpack_capsules_are_taken_once():
    """A "dltensor" capsule itself (torch.utils.dlpack.to_dlpack's) crosses as the array; a capsule
    already taken, or of another name, is refused naming the argument, and nothing is kept."""
    torch = torch_or_skip()
    from torch.utils.dlpack import to_dlpack

    t = torch.arange(24, dtype=torch.float16).reshape(2, 3, 4)
    capsule = to_dlpack(t)
    got = info(capsule)
    assert got == {"protocol": "dlpack", "dtype": "float16", "device": "cpu", "shape": (2, 3, 4), "data": t.data_ptr()}
    with pytest.raises(mixkv.InvalidArgument, match=r"tensor_info: array: .*used or foreign capsule"):
        info(capsule)
    with pytest.raises(mixkv.InvalidArgument, match=r"tensor_info: array: .*got float64"):
        info(to_dlpack(torch.zeros(3, dtype=torch.float64)))
    with pytest.raises(mixkv.InvalidArgument, match=r"non-contiguous"):
        info(to_dlpack(t[:, :, ::2]))


def test_engine_takes_torch_tensors_as_capsules_with_the_same_result():
    """Engine calls on torch's current stream hand plain tensors over as capsules: the outputs equal
    those of NumPy arrays, a tensor that needs a gradient still goes through the protocol (and is
    refused there), and the tensors stay alive and unchanged in reference count."""
    import sys

    torch = torch_or_skip()
    shape = mixkv.CacheShape(2, 2, 64, 16)

    def run(as_torch):
        engine = mixkv.Engine(mixkv.CacheConfig(shape, arena_bytes=8 << 20), num_q_heads=4, backend="cpu")
        engine.add_request("r", 20, max_new_tokens=3)
        rng = np.random.default_rng(1)
        outs = []
        while engine.has_unfinished():
            step = engine.step()
            for layer in range(2):
                if step.prefill_rows:
                    n = step.prefill_rows
                    q, k, v = (rng.standard_normal((n, h, 64)).astype(np.float16) for h in (4, 2, 2))
                    args = [torch.from_numpy(a) for a in (q, k, v)] if as_torch else [q, k, v]
                    outs.append(np.asarray(engine.prefill(layer, *args)))
                if step.decodes:
                    q, k, v = (rng.standard_normal((1, h, 64)).astype(np.float16) for h in (4, 2, 2))
                    args = [torch.from_numpy(a) for a in (q, k, v)] if as_torch else [q, k, v]
                    before = [sys.getrefcount(a) for a in args]
                    outs.append(np.asarray(engine.attend(layer, *args)))
                    assert [sys.getrefcount(a) for a in args] == before
        return outs, engine

    with_torch, engine = run(True)
    with_numpy, _ = run(False)
    assert len(with_torch) == len(with_numpy) > 0
    for a, b in zip(with_torch, with_numpy):
        np.testing.assert_array_equal(a, b)
    engine.add_request("g", 4, max_new_tokens=1)
    step = engine.step()
    assert step.prefill_rows == 4
    k = torch.zeros(4, 2, 64, dtype=torch.float16, requires_grad=True)
    with pytest.raises(mixkv.InvalidArgument, match=r"Engine.store: k: .*(grad|gradient)"):
        engine.store(0, k, k.detach())


def test_torch_cuda_tensors():
    torch = torch_or_skip(cuda=True)
    t = torch.zeros(4, 8, dtype=torch.float16, device="cuda")
    stream = torch.cuda.Stream()
    got = info(t, device="cuda", stream=stream.cuda_stream)
    assert got == {"protocol": "dlpack", "dtype": "float16", "device": "cuda:0", "shape": (4, 8), "data": t.data_ptr()}
    assert info(t[1:], device="cuda")["data"] == t.data_ptr() + 8 * 2
    with pytest.raises(mixkv.InvalidArgument, match=r"on cpu, got float16 on cuda:0"):
        info(t)


def test_cupy_arrays():
    if importlib.util.find_spec("cupy") is None:
        pytest.skip("CuPy is not installed")
    if not mixkv.built_with_cuda:
        pytest.skip("mixkv was built without CUDA (MIXKV_CUDA=OFF)")
    import cupy

    try:
        a = cupy.zeros((2, 3), cupy.float32)
    except Exception as e:  # CuPy without a usable GPU
        pytest.skip(f"CuPy cannot allocate on a GPU: {e}")
    got = info(a, device="cuda")
    assert got["protocol"] == "dlpack" and got["data"] == a.data.ptr and got["device"] == "cuda:0"
