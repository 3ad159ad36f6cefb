"""Build for ulysses-kernels.

The package is pure Python plus an optional CUDA extension (`ulysses_kernels._C`) built
from `csrc/`. The extension is compiled when a CUDA-enabled torch and nvcc are present;
otherwise the install is pure Python and one line on stderr says why (the same reason is
recorded in `ulysses_kernels/_build_info.py` and shown by `ulysses-kernels doctor`).

Environment variables:
  ULYSSES_KERNELS_SKIP_CUDA_BUILD=1   never build the extension
  ULYSSES_KERNELS_FORCE_CUDA_BUILD=1  fail the install if the extension cannot be built
  TORCH_CUDA_ARCH_LIST                arches to compile for (default "8.0;9.0" when no GPU
                                      is visible, else torch's own detection)
  CUDA_HOME                           CUDA toolkit (default: the one holding `nvcc` on PATH,
                                      else /usr/local/cuda)
  MAX_JOBS                            parallel compile jobs (ninja)
  ULYSSES_KERNELS_HOST_COMPILER       the C++ compiler (g++) to build with; default: CXX when
                                      its libstdc++ is the one torch runs with, else a g++ on
                                      PATH whose libstdc++ is (see _match_host_compiler)

Install with `pip install --no-build-isolation -e .` so the build sees your torch.
"""

import glob
import importlib.util
import os
import shutil
import subprocess
import sys

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_ARCH_LIST = "8.0;9.0"
BUILD_INFO = os.path.join(HERE, "ulysses_kernels", "_build_info.py")
PACKAGES = ["ulysses_kernels", "ulysses_kernels.reference", "ulysses_kernels.fused", "ulysses_kernels.hf",
            "ulysses_kernels.testing", "ulysses_kernels.triton"]


def _load_env_module():
    """The package's one parser of boolean environment variables (it imports nothing of
    the package, so it loads before the package is installed)."""
    spec = importlib.util.spec_from_file_location("_ulysses_kernels_env", os.path.join(HERE, "ulysses_kernels", "env.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_env_flag = _load_env_module().flag


def _is_cuda_home(path):
    return bool(path) and os.path.exists(os.path.join(path, "bin", "nvcc")) and \
        os.path.exists(os.path.join(path, "include", "cuda_runtime.h"))


def _find_cuda_home():
    """CUDA_HOME if set, else the toolkit around `nvcc` on PATH, else /usr/local/cuda.

    `nvcc` on PATH may be a wrapper script outside the toolkit (e.g. /usr/local/bin/nvcc),
    so a candidate counts only if it also has the runtime headers.
    """
    if os.environ.get("CUDA_HOME"):
        return os.environ["CUDA_HOME"]
    nvcc = shutil.which("nvcc")
    candidates = [os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))] if nvcc else []
    candidates.append("/usr/local/cuda")
    return next((c for c in candidates if _is_cuda_home(c)), None)


def _nvidia_wheel_root():
    """The `nvidia/` folder of the nvidia-* wheels torch depends on (NCCL: nvidia/nccl)."""
    for site in sys.path:
        root = os.path.join(site, "nvidia")
        if os.path.exists(os.path.join(root, "nccl", "include", "nccl.h")):
            return root
    return None


def _missing_toolkit_headers(root, torch_cuda_major, cuda_home):
    """A folder of links to the headers that torch's CUDA headers include (cuBLAS,
    cuSPARSE, ...) but the toolkit at `cuda_home` lacks (a minimal nvcc install), taken from
    the wheels (cu13: nvidia/cu13/include; cu12: nvidia/*/include). Only missing names are
    linked, so the toolkit's own headers are never shadowed by the wheels'. None when the
    toolkit has them all."""
    toolkit = os.path.join(cuda_home, "include")
    wheel_dirs = [os.path.join(root, f"cu{torch_cuda_major}", "include")]
    wheel_dirs += sorted(glob.glob(os.path.join(root, "*", "include")))
    missing = {}
    for d in wheel_dirs:
        if not os.path.isdir(d) or d.startswith(os.path.join(root, "nccl")):
            continue
        for name in os.listdir(d):
            if not os.path.exists(os.path.join(toolkit, name)):
                missing.setdefault(name, os.path.join(d, name))
    if not missing:
        return None
    folder = os.path.join(HERE, "build", "wheel_cuda_headers")
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    for name, target in missing.items():
        os.symlink(target, os.path.join(folder, name))
    return folder


def _loaded_libstdcxx():
    """Real path of the libstdc++ this process runs with (torch is imported), or None."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1] if len(line.split()) >= 6 else ""
                if os.path.basename(path).startswith("libstdc++.so"):
                    return os.path.realpath(path)
    except OSError:
        pass
    return None


def _compiler_libstdcxx(compiler):
    """Real path of the libstdc++ that `compiler` links against, or None."""
    try:
        out = subprocess.run([compiler, "-print-file-name=libstdc++.so.6"], capture_output=True,
                             text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return os.path.realpath(out) if os.path.isabs(out) and os.path.exists(out) else None


def _match_host_compiler(environ, loaded, runtime_of=_compiler_libstdcxx, which=shutil.which):
    """The C++ compiler to build with, and why, or (None, None) to keep the default.

    An extension linked by a GCC whose libstdc++ differs from the one torch runs with can
    load fine and still crash the process on its first C++ exception (seen on the first GPU
    run: the image's CXX, a second GCC under /opt, segfaulted in every TORCH_CHECK; the
    system g++ built a working one). So when CXX's libstdc++ is not the loaded one, a g++
    on PATH whose libstdc++ is, is used instead.
    """
    forced = environ.get("ULYSSES_KERNELS_HOST_COMPILER")
    if forced:
        return forced, "ULYSSES_KERNELS_HOST_COMPILER"
    current = environ.get("CXX") or "c++"
    mine = runtime_of(current)
    if loaded is None or mine is None or mine == loaded:
        return None, None
    for candidate in ("g++", "c++", "/usr/bin/g++", "/usr/bin/c++"):
        path = which(candidate)
        if path and runtime_of(path) == loaded:
            return path, f"CXX={current} links {mine}, torch runs with {loaded}"
    print(f"ulysses-kernels: warning: CXX={current} links {mine} but torch runs with {loaded}, "
          "and no g++ on PATH matches: C++ errors of the extension may crash the process; set "
          "ULYSSES_KERNELS_HOST_COMPILER", file=sys.stderr)
    return None, None


def _use_host_compiler(compiler, why):
    """CXX: the C++ files and the link. CC (nvcc's -ccbin) stays: that combination is the
    one the first GPU run verified, and nvcc accepts only some GCC versions."""
    os.environ["CXX"] = compiler
    print(f"ulysses-kernels: host compiler {compiler} ({why})", file=sys.stderr)


def _cuda_extension_or_reason():
    """Return (list_of_extensions, cmdclass, reason_if_skipped)."""
    if _env_flag("ULYSSES_KERNELS_SKIP_CUDA_BUILD"):
        return [], {}, "ULYSSES_KERNELS_SKIP_CUDA_BUILD is set"
    try:
        import torch
    except ImportError:
        return [], {}, "torch is not importable at build time (install torch first and use --no-build-isolation)"
    if torch.version.cuda is None:
        return [], {}, f"torch {torch.__version__} is a CPU-only build"
    cuda_home = _find_cuda_home()
    if not _is_cuda_home(cuda_home):
        return [], {}, "no CUDA toolkit found (nvcc and cuda_runtime.h; set CUDA_HOME or put nvcc on PATH)"
    # cpp_extension reads CUDA_HOME when it is imported.
    os.environ["CUDA_HOME"] = cuda_home
    if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        if not torch.cuda.is_available():
            os.environ["TORCH_CUDA_ARCH_LIST"] = DEFAULT_ARCH_LIST
    compiler, why = _match_host_compiler(os.environ, _loaded_libstdcxx())
    if compiler:
        _use_host_compiler(compiler, why)
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    cuda_major = torch.version.cuda.split(".")[0]
    root = _nvidia_wheel_root()
    if root is None:
        return [], {}, "NCCL headers not found (expected the nvidia-nccl wheel that torch depends on)"
    # NCCL's folder, and from the other wheels only what the toolkit lacks.
    wheel_includes = [os.path.join(root, "nccl", "include")]
    extra = _missing_toolkit_headers(root, cuda_major, cuda_home)
    wheel_includes += [extra] if extra else []
    nccl_libs = [os.path.join(root, "nccl", "lib")]
    sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")) + glob.glob(os.path.join("csrc", "*.cu")))
    # No --use_fast_math: the kernels are copies and fp32 sums, where it buys nothing and
    # would flush subnormal gradients to zero.
    # torch's std::string ABI, stated: cpp_extension no longer passes it, and a GCC built
    # with the old default (devtoolset-style) would lay out c10::Error's strings unlike the
    # torch that catches it.
    abi = [f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    nvcc_flags = abi + ["-O3", "-std=c++20", "-lineinfo",
                  "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
                  "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "-U__CUDA_NO_BFLOAT16_OPERATORS__"]
    ext = CUDAExtension(
        name="ulysses_kernels._C",
        sources=sources,
        include_dirs=[os.path.join(HERE, "csrc")] + wheel_includes,
        depends=sorted(glob.glob(os.path.join("csrc", "*.h"))),  # rebuild when pack_index.h changes
        library_dirs=nccl_libs,
        # libnccl.so.2 is what torch itself loads; link the soname so both share one copy.
        extra_link_args=[f"-Wl,-rpath,{d}" for d in nccl_libs] + ["-l:libnccl.so.2"],
        extra_compile_args={"cxx": abi + ["-O3", "-std=c++20"], "nvcc": nvcc_flags},
    )
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}, None


def _write_build_info(reason):
    arch = os.environ.get("TORCH_CUDA_ARCH_LIST", "")
    with open(BUILD_INFO, "w") as f:
        f.write("# Written by setup.py; read by `ulysses-kernels doctor`.\n")
        f.write(f"CUDA_EXTENSION_SKIPPED_REASON = {reason!r}\n")
        f.write(f"TORCH_CUDA_ARCH_LIST = {arch!r}\n")


ext_modules, cmdclass, skip_reason = _cuda_extension_or_reason()
if skip_reason is not None:
    if _env_flag("ULYSSES_KERNELS_FORCE_CUDA_BUILD"):
        raise RuntimeError(f"ulysses-kernels: cannot build the CUDA extension: {skip_reason}")
    print(f"ulysses-kernels: CUDA extension skipped: {skip_reason}; installing pure Python "
          "(reference and Triton paths only)", file=sys.stderr)
else:
    print(f"ulysses-kernels: building CUDA extension for TORCH_CUDA_ARCH_LIST="
          f"{os.environ.get('TORCH_CUDA_ARCH_LIST', '(torch default)')}", file=sys.stderr)
_write_build_info(skip_reason)

setup(
    name="ulysses-kernels",
    version="0.1.0",
    description="Ulysses sequence parallelism for PyTorch with fused communication and "
                "Triton attention over the head-sharded layout",
    long_description=open(os.path.join(HERE, "README.md")).read() if os.path.exists(os.path.join(HERE, "README.md")) else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=PACKAGES,
    package_dir={"ulysses_kernels": "ulysses_kernels", "ulysses_kernels.triton": "triton_kernels"},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    install_requires=["torch>=2.4", "triton>=3.6; platform_system == 'Linux'"],
    extras_require={
        "test": ["pytest>=7", "numpy", "hypothesis", "ruff", "import-linter>=2.13", "pytest-timeout",
                 "pytest-benchmark"],
        # Trainer / TRL integration (hf/trainer.py): the versions it is tested with.
        "hf": ["transformers>=5.24,<6", "accelerate>=1.15,<2", "trl>=1.16,<2", "datasets>=5"],
        "bench": ["matplotlib", "numpy", "pytest-benchmark"],
    },
    entry_points={"console_scripts": ["ulysses-kernels=ulysses_kernels.cli:main"]},
    zip_safe=False,
)
