#!/usr/bin/env bash
# Builds a TRIMMED FlashInfer wheel for the GPU machine, which has no network
# and a 64 MiB carry limit (source tree included): flashinfer-python
# 0.7.2.post1 (62 MB) without the CUDA sources of every other JIT module,
# plus apache-tvm-ffi, into .whl/ (git-ignored). What stays:
#   - every Python file of the package (flashinfer/__init__.py imports most
#     submodules eagerly) and its small non-Python files,
#   - flashinfer/data/include (the flashinfer/ headers),
#   - flashinfer/data/csrc: the top-level sources and templates of the
#     batch/single prefill and decode, POD, page and cascade modules, the
#     top-level headers, and whatever those include from csrc (closure),
#   - flashinfer/data/cutlass/include and cutlass/tools/util/include (the
#     sm90 FA3 prefill backend is CUTLASS/CuTe), flashinfer/data/cccl's
#     cub, libcudacxx/include and thrust (jit/env.py puts them first on the
#     include path), flashinfer/data/spdlog/include.
# Then checks: the size, every csrc file the prefill/decode JIT generators
# name exists, every csrc include of the kept files resolves, and the wheel
# installs into a fresh venv (pip --no-deps) and byte-compiles; `import
# flashinfer` is tried there too (it needs torch, which a machine without
# it lacks: then the import is expected to stop at `import torch`).
#
# Usage: scripts/pack_flashinfer.sh [--no-verify]
#   FI_WHEELS=/tmp/fi (where the original wheels are; downloaded if missing)
#   PY_TAG=312 (the device's Python: the apache-tvm-ffi wheel copied to .whl/)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
FI_WHEELS=${FI_WHEELS:-/tmp/fi}
PY_TAG=${PY_TAG:-312}
VERSION=0.7.2.post1
FI_WHL=flashinfer_python-$VERSION-py3-none-any.whl
DEST=$ROOT/.whl
VERIFY=1
[ "${1:-}" = "--no-verify" ] && VERIFY=0

mkdir -p "$FI_WHEELS"
if [ ! -f "$FI_WHEELS/$FI_WHL" ]; then
  pip download --no-deps -d "$FI_WHEELS" "flashinfer-python==$VERSION"
fi
if ! ls "$FI_WHEELS"/apache_tvm_ffi-*-cp"$PY_TAG"-*.whl >/dev/null 2>&1; then
  pip download --no-deps -d "$FI_WHEELS" --python-version "${PY_TAG:0:1}.${PY_TAG:1}" --only-binary=:all: \
    --platform manylinux_2_28_x86_64 apache-tvm-ffi
fi
TVM_WHL=$(ls "$FI_WHEELS"/apache_tvm_ffi-*-cp"$PY_TAG"-*.whl | sort | tail -1)

STAGE=$(mktemp -d /tmp/fi-pack.XXXXXX)
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$DEST"
rm -f "$DEST"/flashinfer_python-*.whl "$DEST"/apache_tvm_ffi-*.whl

python3 - "$FI_WHEELS/$FI_WHL" "$STAGE" "$DEST/$FI_WHL" <<'PY'
import base64, hashlib, os, re, sys, zipfile

src, stage, out = sys.argv[1:4]
zin = zipfile.ZipFile(src)
names = zin.namelist()
CSRC = "flashinfer/data/csrc/"
DATA = "flashinfer/data/"

# Top-level csrc files of the modules the benchmarks use (prefill and decode,
# fa2 and sm90 fa3, fp8, single and batch, POD, page append, cascade merge),
# and every top-level header.
ROOT_RE = re.compile(
    r"^(batch_prefill|batch_decode(?!_mla)|batch_pod|pod_|pod\.cu|single_prefill|single_decode|page\.cu|"
    r"flashinfer_page_binding|cascade\.cu|flashinfer_cascade_binding)")
csrc_top = {n[len(CSRC):] for n in names if n.startswith(CSRC) and "/" not in n[len(CSRC):]}
keep_csrc = {f for f in csrc_top if ROOT_RE.match(f) or f.endswith((".h", ".cuh"))}

# Include closure inside csrc (quoted includes resolve next to the file, then
# at csrc's root: csrc is on the include path, see jit/cpp_ext.py).
all_csrc = {n[len(CSRC):] for n in names if n.startswith(CSRC) and not n.endswith("/")}
inc_re = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.M)
todo = list(keep_csrc)
while todo:
    f = todo.pop()
    text = zin.read(CSRC + f).decode("utf-8", "replace")
    for inc in inc_re.findall(text):
        for cand in (os.path.normpath(os.path.join(os.path.dirname(f), inc)), inc):
            if cand in all_csrc and cand not in keep_csrc:
                keep_csrc.add(cand)
                todo.append(cand)
                break

def keep(n):
    if n.endswith("/"):
        return False
    if not n.startswith(DATA):
        return True  # the Python package, top-level modules, dist-info
    rest = n[len(DATA):]
    if rest.startswith("csrc/"):
        return rest[len("csrc/"):] in keep_csrc
    if rest.startswith("include/"):
        return True
    if rest.startswith("cutlass/"):
        return rest.startswith(("cutlass/include/", "cutlass/tools/util/include/"))
    if rest.startswith("cccl/"):
        return rest.startswith(("cccl/cub/", "cccl/libcudacxx/include/", "cccl/thrust/"))
    if rest.startswith("spdlog/"):
        return rest.startswith("spdlog/include/")
    return "/" not in rest  # data/build_backend.py etc.

kept = [n for n in names if keep(n) and not n.endswith(".dist-info/RECORD")]
record_name = next(n for n in names if n.endswith(".dist-info/RECORD"))
rows = []
with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
    for n in kept:
        info = zin.getinfo(n)
        data = zin.read(n)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        rows.append(f"{n},sha256={digest},{len(data)}")
        zi = zipfile.ZipInfo(n, date_time=info.date_time)
        zi.external_attr = info.external_attr
        zi.compress_type = zipfile.ZIP_DEFLATED
        zout.writestr(zi, data, compresslevel=9)
    rows.append(f"{record_name},,")
    zout.writestr(record_name, "\n".join(rows) + "\n")
dropped = len([n for n in names if not n.endswith("/")]) - len(kept) - 1
with open(os.path.join(stage, "kept_csrc.txt"), "w") as f:
    f.write("\n".join(sorted(keep_csrc)) + "\n")
print(f"kept {len(kept)} files ({len(keep_csrc)} of {len(all_csrc)} csrc files), dropped {dropped}")
PY
cp "$TVM_WHL" "$DEST/"
du -ch "$DEST"/*.whl
total=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
if [ "$total" -gt $((45 * 1000 * 1000)) ]; then
  echo "ERROR: .whl/ holds $total bytes: over the 45 MB budget"
  exit 1
fi
[ "$VERIFY" = 1 ] || exit 0

# --- verify
echo "== verify: the JIT generators' csrc files are in the trimmed wheel"
X=$STAGE/x
mkdir -p "$X"
python3 -m zipfile -e "$DEST/$FI_WHL" "$X"
python3 - "$X/flashinfer" "$FI_WHEELS/$FI_WHL" <<'PY'
import ast, re, sys, pathlib
pkg = pathlib.Path(sys.argv[1])
csrc = pkg / "data" / "csrc"
# String literals naming csrc files inside the generators the prefill and
# decode wrappers (and POD, page, cascade) call.
wanted_funcs = re.compile(
    r"^(gen_batch_prefill_module|_gen_batch_prefill_module|gen_customize_batch_prefill_module|"
    r"gen_batch_decode_module|gen_customize_batch_decode_module|gen_single_prefill_module|"
    r"gen_customize_single_prefill_module|gen_single_decode_module|gen_customize_single_decode_module|"
    r"gen_pod_module|gen_customize_pod_module|gen_batch_pod_module|gen_customize_batch_pod_module|"
    r"gen_page_module|gen_cascade_module)$")
missing, checked = [], set()
for py in [pkg / "jit" / "attention" / "modules.py", pkg / "jit" / "page.py", pkg / "jit" / "cascade.py"]:
    if not py.exists():
        continue
    tree = ast.parse(py.read_text())
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef) or not wanted_funcs.match(fn.name):
            continue
        # Pieces of f-strings name generated files: skip them.
        in_fstring = {id(v) for j in ast.walk(fn) if isinstance(j, ast.JoinedStr) for v in j.values}
        for node in ast.walk(fn):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in in_fstring:
                s = node.value
                if re.fullmatch(r"[\w./-]+\.(cu|cuh|h|jinja)", s) and "{" not in s:
                    checked.add(s)
                    # Generated files (written into the gen dir) are not in csrc.
                    if not (csrc / s).exists() and "_kernel_mask_" not in s and not s.endswith("_kernel.cu"):
                        missing.append(f"{py.name}:{fn.name}: {s}")
print(f"checked {len(checked)} csrc names from the generators")
# Every include of a kept csrc file that the ORIGINAL wheel could resolve
# (csrc, data/include, cutlass, spdlog) resolves in the trimmed one too.
import zipfile
orig = {n for n in zipfile.ZipFile(sys.argv[2]).namelist() if not n.endswith("/")}
data_roots = ["csrc", "include", "cutlass/include", "cutlass/tools/util/include", "spdlog/include"]
inc_re = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.M)
hard = []
for f in csrc.rglob("*"):
    if not f.is_file():
        continue
    rel_dir = f.parent.relative_to(pkg / "data")
    for inc in inc_re.findall(f.read_text(errors="replace")):
        cands = [str(rel_dir / inc)] + [f"{r}/{inc}" for r in data_roots]
        cands = [c.replace("/./", "/") for c in cands]
        if any(("flashinfer/data/" + c) in orig for c in cands) and not any((pkg / "data" / c).exists() for c in cands):
            hard.append(f"{f.relative_to(csrc)}: {inc}")
if missing or hard:
    print("MISSING:", *missing, *hard, sep="\n  ")
    sys.exit(1)
print("all generator csrc files and flashinfer/cutlass/cute includes present")
PY

echo "== verify: pip install --no-deps into a fresh venv, byte-compile, import"
VENV=$STAGE/venv
python3 -m venv "$VENV"
# The local interpreter's tvm-ffi wheel, same version (the one in .whl/ is for cp$PY_TAG).
TVM_VERSION=$(basename "$TVM_WHL" | cut -d- -f2)
LOCAL_TAG=$("$VENV/bin/python" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')
LOCAL_TVM=$(ls "$FI_WHEELS"/apache_tvm_ffi-"$TVM_VERSION"-cp"$LOCAL_TAG"-*.whl 2>/dev/null | tail -1 || true)
if [ -z "$LOCAL_TVM" ]; then
  pip download --no-deps -d "$FI_WHEELS" --only-binary=:all: "apache-tvm-ffi==$TVM_VERSION" >/dev/null
  LOCAL_TVM=$(ls "$FI_WHEELS"/apache_tvm_ffi-"$TVM_VERSION"-cp"$LOCAL_TAG"-*.whl | tail -1)
fi
"$VENV/bin/pip" install --quiet --no-deps --no-index "$DEST/$FI_WHL" "$LOCAL_TVM"
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
"$VENV/bin/python" -m compileall -q "$SITE/flashinfer" >/dev/null && echo "byte-compiled flashinfer/ in the venv"
# The interpreter's own site-packages (jinja2, numpy, packaging, ...) stay visible.
SYS_SITE=$(python3 -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
set +e
echo "plain import: $(PYTHONPATH="$SYS_SITE" "$VENV/bin/python" -c \
  'import flashinfer; print("import flashinfer: ok", flashinfer.__version__)' 2>&1 | tail -1)" \
  "$(python3 -c 'import torch' 2>/dev/null || echo '(no torch on this machine: expected to stop at import torch)')"
set -e

# Without torch and a GPU (this machine), `import flashinfer` stops at
# `import torch`. To go further, import it with torch, the CUDA Python
# bindings, pynvml and tqdm stubbed (a CPU-only torch: no device), generate
# the FA2 / FA3 / FP8-KV prefill and the decode JIT modules (this renders
# their templates from csrc and writes build.ninja), then preprocess every
# generated source with nvcc and FlashInfer's own flags: the include closure
# of what was kept resolves.
echo "== verify: import with stubs, generate the prefill/decode JIT modules, nvcc -E their sources"
cat >"$STAGE/stub_import.py" <<'STUB'
import importlib.abc, importlib.machinery, sys, types
from unittest import mock
STUBBED = set()
STUBBABLE = {"torch", "triton", "cuda", "cuda_tile", "nvidia", "nccl4py", "nccl_extensions",
             "pynvml", "einops", "tabulate", "tqdm", "filelock", "safetensors", "rich", "cupy", "nvtx"}
class Stub(mock.MagicMock):
    def __mro_entries__(self, bases):  # `class X(torch.nn.Module)`
        return (object,)
    def __getattr__(self, name):
        if name.startswith("_"):
            return super().__getattr__(name)
        root = self._extract_mock_name().split(".")[0]
        if ((root == "torch" and name in ("Tensor", "Module", "Function", "Generator", "Stream", "Event", "Size",
                                          "device", "dtype"))
                or (root == "cuda" and name[:1].isupper())):
            t = type(name, (), {"__init__": lambda self, *a, **k: None})  # isinstance() needs a type
            object.__setattr__(self, name, t)
            return t
        return super().__getattr__(name)
class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] not in STUBBABLE:
            return None
        for f in sys.meta_path:
            if f is self:
                continue
            try:
                if f.find_spec(name, path, target) is not None:
                    return None  # really installed
            except Exception:
                pass
        STUBBED.add(name.split(".")[0])
        return importlib.machinery.ModuleSpec(name, self, is_package=True)
    def create_module(self, spec):
        if spec.name == "torch.cuda" and "torch" in sys.modules:
            return sys.modules["torch"].cuda
        m = Stub(name=spec.name)
        m.__path__, m.__spec__, m.__name__, m.__version__ = [], spec, spec.name, "2.11.0"
        if spec.name == "torch":
            object.__setattr__(m, "finfo", lambda *a, **k: types.SimpleNamespace(max=448.0, min=-448.0, eps=1e-3,
                                                                                 tiny=1e-30, bits=16))
            object.__setattr__(m, "iinfo", lambda *a, **k: types.SimpleNamespace(max=2**31 - 1, min=-2**31, bits=32))
            c = Stub(name="torch.cuda")
            object.__setattr__(c, "is_available", lambda: False)
            object.__setattr__(c, "device_count", lambda: 0)
            c.__path__ = []
            object.__setattr__(m, "cuda", c)
        if spec.name == "torch.torch_version":
            from packaging.version import Version
            class TorchVersion(str):
                def __lt__(self, o): return Version(str(self)) < Version(str(o))
                def __le__(self, o): return Version(str(self)) <= Version(str(o))
                def __gt__(self, o): return Version(str(self)) > Version(str(o))
                def __ge__(self, o): return Version(str(self)) >= Version(str(o))
            object.__setattr__(m, "TorchVersion", TorchVersion)
            object.__setattr__(m, "__version__", TorchVersion("2.11.0"))
        if spec.name == "torch.version":
            object.__setattr__(m, "cuda", "13.0")
            object.__setattr__(m, "__version__", "2.11.0")
        return m
    def exec_module(self, module):
        pass
sys.meta_path.append(Finder())
import flashinfer  # noqa: E402
from flashinfer import BatchPrefillWithPagedKVCacheWrapper, BatchDecodeWithPagedKVCacheWrapper  # noqa: E402,F401
print("import flashinfer (stubbed:", ", ".join(sorted(STUBBED)) + "): ok")
import os, torch  # noqa: E402
from flashinfer.jit.attention import modules as M  # noqa: E402
# What BatchPrefillWithPagedKVCacheWrapper loads: fa2 its "primary" (equal-stride) module, fa3 the full one.
fa2 = getattr(M, "_gen_batch_prefill_primary_module", M.gen_batch_prefill_module)
def args(kv):  # q, kv, o, index dtypes, head dims, no rope / sliding window / soft cap / fp16 qk
    return (torch.float16, kv, torch.float16, torch.int32, 128, 128, 0, False, False, False)
specs = [fa2("fa2", *args(torch.float16)), M.gen_batch_prefill_module("fa3", *args(torch.float16)),
         fa2("fa2", *args(torch.float8_e4m3fn))]
specs.append(M.gen_batch_decode_module(torch.float16, torch.float16, torch.float16, torch.int32, 128, 128, 0,
                                       False, False))
with open(sys.argv[1], "w") as out:
    for spec in specs:
        assert all(os.path.exists(s) for s in spec.sources), spec.name
        spec.write_ninja()
        out.write(f"{spec.ninja_path}\n")
        print(f"generated {spec.name}: {len(spec.sources)} sources")
STUB
cat >"$STAGE/preprocess.py" <<'PRE'
import concurrent.futures as cf, os, pathlib, re, shlex, subprocess, sys
def parse(path):
    text = pathlib.Path(path).read_text().replace("$\n", " ")
    var, srcs = {}, []
    for line in text.splitlines():
        if m := re.match(r"^(\w+) = (.*)$", line):
            var[m.group(1)] = m.group(2)
        if m := re.match(r"^build (\S+): cuda_compile (\S+)", line):
            srcs.append(m.group(2))
    def expand(s):
        for _ in range(5):
            s = re.sub(r"\$(\w+)", lambda m: var.get(m.group(1), ""), s)
        return s
    flags = [f for f in shlex.split(expand(var["cuda_cflags"]))
             if not f.startswith(("--threads", "-Xfatbin", "--compress-mode"))]
    return expand(var["nvcc"]), flags, srcs
jobs = []
for ninja in pathlib.Path(sys.argv[1]).read_text().split():
    nvcc, flags, srcs = parse(ninja)
    jobs += [(s, [nvcc, *flags, "-E", "-x", "cu", s, "-o", os.devnull]) for s in srcs]
def run(job):
    p = subprocess.run(job[1], capture_output=True, text=True)
    return job[0], p.returncode, p.stderr[-800:]
bad = 0
with cf.ThreadPoolExecutor(os.cpu_count() or 2) as ex:
    for src, rc, err in ex.map(run, jobs):
        if rc:
            bad += 1
            print("FAIL", pathlib.Path(src).name, err, sep="\n")
print(f"nvcc -E: {len(jobs) - bad} of {len(jobs)} generated sources preprocess")
sys.exit(1 if bad else 0)
PRE
NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$NVCC")")}
export CUDA_HOME FLASHINFER_WORKSPACE_BASE=$STAGE/ws FLASHINFER_CUDA_ARCH_LIST=9.0a
PYTHONPATH="$SYS_SITE" "$VENV/bin/python" -W ignore "$STAGE/stub_import.py" "$STAGE/ninjas.txt" 2>&1 |
  grep -v "Failed to get device capability\|torch-c-dlpack\|UserWarning"
[ "${PIPESTATUS[0]}" = 0 ] || { echo "ERROR: stubbed import or JIT generation failed"; exit 1; }
if [ -x "$NVCC" ]; then
  python3 "$STAGE/preprocess.py" "$STAGE/ninjas.txt"
else
  echo "no nvcc here: preprocessing skipped"
fi
echo "done: $(ls "$DEST")"
