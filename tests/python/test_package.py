"""The installed package: stubs that name exactly what the extension has,
docstrings, py.typed, and the CUDA module's absence in a CPU-only build."""

import ast
import inspect
import pathlib

import mixkv
import pytest
from mixkv import _core

PACKAGE = pathlib.Path(mixkv.__file__).parent
# Members every pybind11 class has or that the stubs leave to object.
IGNORED = {
    "__repr__",
    "__hash__",
    "__module__",
    "__doc__",
    "__dict__",
    "__weakref__",
    "__getstate__",
    "__setstate__",
    "__members__",
    "__pybind11_module_local_v5_gcc_libstdcpp_cxxabi1020__",
}


def stub(name):
    """Top-level definitions of a stub file: {name: set of member names or None}."""
    tree = ast.parse((PACKAGE / name).read_text())
    names = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            members = set()
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    members.add(item.name)
                elif isinstance(item, ast.AnnAssign):
                    members.add(item.target.id)
                elif isinstance(item, ast.Assign):
                    members.update(t.id for t in item.targets)
            names[node.name] = members
        elif isinstance(node, ast.FunctionDef):
            names[node.name] = None
        elif isinstance(node, ast.AnnAssign):
            names[node.target.id] = None
        # Plain assignments are the stubs' own type aliases (Stream, _F16...).
    return names


def runtime_members(cls):
    return {
        m
        for m in vars(cls)
        if (not m.startswith("_") or m in ("__init__", "__eq__", "__contains__", "__cuda_array_interface__"))
    } - IGNORED


def check_module(module, stubbed, skip=()):
    public = {n for n in dir(module) if not n.startswith("_")} - set(skip)
    stub_public = {n for n in stubbed if not n.startswith("_")}
    assert public == stub_public
    for name in public:
        obj = getattr(module, name)
        if inspect.isclass(obj) and not issubclass(obj, BaseException) and stubbed[name] is not None:
            if issubclass(obj, int):  # enums: their values
                assert set(obj.__members__) == stubbed[name], name
            else:
                members = runtime_members(obj)
                if "__init__" not in stubbed[name]:  # pybind11's "No constructor defined" placeholder
                    with pytest.raises(TypeError, match="No constructor defined"):
                        obj()
                    members.discard("__init__")
                assert members == stubbed[name], name


def test_core_stubs_match_the_extension():
    check_module(_core, stub("_core.pyi"), skip={"cuda"})


def test_ops_stubs_match():
    stubbed = stub("ops.pyi")
    assert set(mixkv.ops.__all__) == set(stubbed) - {"CudaArray", "__all__"}
    check_module(_core.ops, {n: m for n, m in stubbed.items() if n != "CudaArray"})
    for name in mixkv.ops.__all__:
        assert getattr(mixkv.ops, name).__doc__


@pytest.mark.skipif(not mixkv.built_with_cuda, reason="mixkv was built without CUDA (MIXKV_CUDA=OFF)")
def test_cuda_stubs_match():
    import mixkv.cuda

    stubbed = stub("cuda.pyi")
    check_module(_core.cuda, stubbed)
    assert set(mixkv.cuda.__all__) == {n for n in stubbed if not n.startswith("_")}


@pytest.mark.skipif(mixkv.built_with_cuda, reason="mixkv was built with CUDA")
def test_cuda_module_says_why_it_is_missing():
    with pytest.raises(ImportError, match="built without CUDA"):
        import mixkv.cuda  # noqa: F401


def test_package_exports_and_docs():
    assert set(mixkv.__all__) <= set(dir(mixkv))
    assert (PACKAGE / "py.typed").exists()
    for name in mixkv.__all__:
        obj = getattr(mixkv, name)
        if inspect.isclass(obj) or callable(obj):
            assert obj.__doc__, name
    assert "KVCache" in mixkv.__doc__
