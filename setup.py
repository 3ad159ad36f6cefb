"""The build of the CUDA extension `ulysses_kernels._C` (csrc/); the package's metadata,
version and dependencies are in pyproject.toml.

The extension is compiled when a CUDA-enabled torch and nvcc are present; otherwise the
install is pure Python and one line on stderr says why. At import only the CUDA toolkit
is located (two file checks, so that torch's build command, which reads CUDA_HOME when it
is imported, finds it); nothing is compiled, linked or written until the build command is
set up (`BuildExtension`). It then records what it built, or why not, in
`ulysses_kernels/_build_info.py` next to the extension (shown by `ulysses-kernels doctor`).

Environment variables (docs/env.md):
  ULYSSES_KERNELS_SKIP_CUDA_BUILD=1   never build the extension
  ULYSSES_KERNELS_FORCE_CUDA_BUILD=1  fail the install if the extension cannot be built
  ULYSSES_KERNELS_HOST_COMPILER       the C++ compiler (g++) to build with; default: CXX when
                                      its libstdc++ is the one torch runs with, else a g++ on
                                      PATH whose libstdc++ is (see match_host_compiler)
  TORCH_CUDA_ARCH_LIST                arches to compile for (default "8.0;9.0" when no GPU
                                      is visible, else torch's own detection)
  CUDA_HOME                           CUDA toolkit (default: the one holding `nvcc` on PATH,
                                      else /usr/local/cuda)
  MAX_JOBS                            parallel compile jobs (ninja)

Install with `pip install --no-build-isolation -e .` so the build sees your torch.
"""

import glob
import importlib.util
import os
import shutil
import subprocess
import sys
import warnings

from setuptools import Extension, setup

# numpy is a runtime dependency (pyproject.toml) that pip installs after the build: torch
# warns on import that it is missing, which the build does not need.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_ARCH_LIST = "8.0;9.0"
EXTENSION = "ulysses_kernels._C"

def _load_env_module():
    """The package's parser of environment variables (it imports nothing of the package,
    so it loads before the package is installed)."""
    spec = importlib.util.spec_from_file_location("_ulysses_kernels_env", os.path.join(HERE, "ulysses_kernels", "env.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _is_cuda_home(path):
    return bool(path) and os.path.exists(os.path.join(path, "bin", "nvcc")) and \
        os.path.exists(os.path.join(path, "include", "cuda_runtime.h"))


def find_cuda_home():
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


def nvidia_wheel_root():
    """The `nvidia/` folder of the nvidia-* wheels torch depends on (NCCL: nvidia/nccl)."""
    for site in sys.path:
        root = os.path.join(site, "nvidia")
        if os.path.exists(os.path.join(root, "nccl", "include", "nccl.h")):
            return root
    return None


def link_missing_toolkit_headers(root, torch_cuda_major, cuda_home, folder):
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


HOST_COMPILER_NOTE = ""  # the compiler the build chose and why (the build log, _build_info.py)


def match_host_compiler(environ, loaded, runtime_of=_compiler_libstdcxx, which=shutil.which):
    """The C++ compiler to build with, and why, or (None, None) to keep the default.

    An extension linked by a GCC whose libstdc++ differs from the one torch runs with can
    load fine and still crash the process on its first C++ exception (seen on the first GPU
    run: the image's CXX, a second GCC under /opt, segfaulted in every TORCH_CHECK; the
    system g++ built a working one). So when CXX's libstdc++ is not the loaded one, a g++
    on PATH whose libstdc++ is, is used instead. A compiler that names no shared libstdc++
    (`-print-file-name` finds none: it may link a static one) counts as not matching: the
    second GPU run kept such a CXX and crashed the same way.
    """
    variable = _load_env_module().HOST_COMPILER.name
    forced = environ.get(variable)
    if forced:
        return forced, variable
    current = environ.get("CXX") or "c++"
    mine = runtime_of(current)
    if loaded is None or mine == loaded:
        return None, None
    links = mine or "no shared libstdc++ it can name"
    for candidate in ("g++", "c++", "/usr/bin/g++", "/usr/bin/c++"):
        path = which(candidate)
        if path and runtime_of(path) == loaded:
            return path, f"CXX={current} links {links}, torch runs with {loaded}"
    print(f"ulysses-kernels: warning: CXX={current} links {links} but torch runs with {loaded}, "
          "and no g++ on PATH matches: C++ errors of the extension may crash the process; set "
          f"{variable}", file=sys.stderr)
    return None, None


def cuda_extension_or_reason(build_dir):
    """(the CUDAExtension to build, None) or (None, why it is skipped). Configures the
    environment the compile needs (CUDA_HOME, TORCH_CUDA_ARCH_LIST, CXX) on the way; header
    links go under `build_dir`."""
    env = _load_env_module()
    if env.flag(env.SKIP_CUDA_BUILD):
        return None, f"{env.SKIP_CUDA_BUILD.name} is set"
    try:
        import torch
    except ImportError:
        return None, "torch is not importable at build time (install torch first and use --no-build-isolation)"
    if torch.version.cuda is None:
        return None, f"torch {torch.__version__} is a CPU-only build"
    cuda_home = find_cuda_home()
    if not _is_cuda_home(cuda_home):
        return None, "no CUDA toolkit found (nvcc and cuda_runtime.h; set CUDA_HOME or put nvcc on PATH)"
    root = nvidia_wheel_root()
    if root is None:
        return None, "NCCL headers not found (expected the nvidia-nccl wheel that torch depends on)"
    import torch.utils.cpp_extension as cpp_extension

    if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
        os.environ["TORCH_CUDA_ARCH_LIST"] = DEFAULT_ARCH_LIST
    loaded = _loaded_libstdcxx()
    compiler, why = match_host_compiler(os.environ, loaded)
    if compiler:
        # CXX: the C++ files and the link. CC (nvcc's -ccbin) stays: that combination is the
        # one the first GPU run verified, and nvcc accepts only some GCC versions.
        os.environ["CXX"] = compiler
    # Always stated (build log, and _build_info for the doctor): the GPU image's crash on C++
    # errors is diagnosed from this line.
    global HOST_COMPILER_NOTE
    chosen = os.environ.get("CXX") or "c++"
    HOST_COMPILER_NOTE = (f"{chosen} (libstdc++ {_compiler_libstdcxx(chosen)}; torch runs with {loaded}; "
                          f"{'chosen because ' + why if compiler else 'kept'})")
    print(f"ulysses-kernels: host compiler {HOST_COMPILER_NOTE}", file=sys.stderr)
    # NCCL's folder, and from the other wheels only what the toolkit lacks.
    includes = [os.path.join(root, "nccl", "include")]
    extra = link_missing_toolkit_headers(root, torch.version.cuda.split(".")[0], cuda_home,
                                         os.path.join(build_dir, "wheel_cuda_headers"))
    includes += [extra] if extra else []
    nccl_libs = [os.path.join(root, "nccl", "lib")]
    # torch's std::string ABI, stated: cpp_extension no longer passes it, and a GCC built
    # with the old default (devtoolset-style) would lay out c10::Error's strings unlike the
    # torch that catches it.
    abi = [f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    # No --use_fast_math: the kernels are copies and fp32 sums, where it buys nothing and
    # would flush subnormal gradients to zero.
    nvcc_flags = abi + ["-O3", "-std=c++20", "-lineinfo",
                        "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
                        "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "-U__CUDA_NO_BFLOAT16_OPERATORS__"]
    ext = cpp_extension.CUDAExtension(
        name=EXTENSION,
        sources=sorted(glob.glob(os.path.join("csrc", "*.cpp")) + glob.glob(os.path.join("csrc", "*.cu"))),
        include_dirs=[os.path.join(HERE, "csrc")] + includes,
        depends=sorted(glob.glob(os.path.join("csrc", "*.h"))),  # rebuild when pack_index.h changes
        library_dirs=nccl_libs,
        # libnccl.so.2 is what torch itself loads; link the soname so both share one copy.
        extra_link_args=[f"-Wl,-rpath,{d}" for d in nccl_libs] + ["-l:libnccl.so.2"],
        extra_compile_args={"cxx": abi + ["-O3", "-std=c++20"], "nvcc": nvcc_flags},
    )
    return ext, None


# torch's build command reads CUDA_HOME when it is imported: point it at the toolkit found
# here (two file checks), then take it as the base when torch is importable (it must be,
# to compile anything).
_cuda_home = find_cuda_home()
if _cuda_home:
    os.environ["CUDA_HOME"] = _cuda_home
try:
    from torch.utils.cpp_extension import BuildExtension as _BaseBuild
except ImportError:
    from setuptools.command.build_ext import build_ext as _BaseBuild


class BuildExtension(_BaseBuild):
    """Decides when the build command is set up whether the extension can be built
    (`finalize_options`), builds it (torch's BuildExtension with ninja) or says why not,
    and writes `_build_info.py` next to where the extension goes (the source tree for an
    editable install, the wheel otherwise)."""

    def __init__(self, *args, **kwargs):
        if _BaseBuild.__module__.startswith("torch"):
            kwargs.setdefault("use_ninja", True)
        super().__init__(*args, **kwargs)

    def finalize_options(self):
        ext, self.skip_reason = cuda_extension_or_reason(os.path.join(HERE, "build"))
        self.distribution.ext_modules = [ext] if ext is not None else []
        super().finalize_options()

    def run(self):
        env = _load_env_module()
        self._write_build_info(self.skip_reason)
        if self.skip_reason is not None:
            if env.flag(env.FORCE_CUDA_BUILD):
                raise RuntimeError(f"ulysses-kernels: cannot build the CUDA extension: {self.skip_reason}")
            print(f"ulysses-kernels: CUDA extension skipped: {self.skip_reason}; installing pure Python "
                  "(reference and Triton paths only)", file=sys.stderr)
            return
        print(f"ulysses-kernels: building CUDA extension for TORCH_CUDA_ARCH_LIST="
              f"{os.environ.get('TORCH_CUDA_ARCH_LIST', '(torch default)')}", file=sys.stderr)
        super().run()

    def _build_info_path(self):
        return os.path.join(os.path.dirname(self.get_ext_fullpath(EXTENSION)), "_build_info.py")

    def _write_build_info(self, reason):
        path = self._build_info_path()
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write("# Written by setup.py's build; read by `ulysses-kernels doctor`.\n")
            f.write(f"CUDA_EXTENSION_SKIPPED_REASON = {reason!r}\n")
            f.write(f"TORCH_CUDA_ARCH_LIST = {os.environ.get('TORCH_CUDA_ARCH_LIST', '')!r}\n")
            f.write(f"HOST_COMPILER = {HOST_COMPILER_NOTE!r}\n")

    def get_outputs(self):
        return super().get_outputs() + [self._build_info_path()]


if __name__ == "__main__":
    # The extension is declared here and decided on by BuildExtension.
    setup(ext_modules=[Extension(EXTENSION, sources=[])], cmdclass={"build_ext": BuildExtension})
