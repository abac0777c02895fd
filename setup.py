"""Builds flowkit's native ops (``flowkit._C``) from ``csrc/``: C++ always, CUDA where a toolkit and a CUDA torch exist.

Set ``FLOWKIT_BUILD_NATIVE=0`` to skip the extension (flowkit then falls back to Triton / reference ops).
"""

import glob
import os

from setuptools import setup


def native_extensions():
    if os.environ.get("FLOWKIT_BUILD_NATIVE", "1") == "0":
        return [], {}
    sources = sorted(glob.glob("csrc/**/*.cpp", recursive=True))
    if not sources:
        return [], {}
    import torch
    from torch.utils import cpp_extension

    cuda_sources = sorted(glob.glob("csrc/**/*.cu", recursive=True))
    use_cuda = bool(cuda_sources) and torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None
    extra = {"cxx": ["-O3", "-fno-math-errno", "-fno-trapping-math", "-fopenmp", "-std=c++20"]}
    kwargs = {"extra_compile_args": extra, "extra_link_args": ["-fopenmp"]}
    if use_cuda:
        extra["nvcc"] = ["-O3", "--use_fast_math", "-std=c++20"]
        ext = cpp_extension.CUDAExtension("flowkit._C", sources + cuda_sources, define_macros=[("FLOWKIT_WITH_CUDA", None)], **kwargs)
    else:
        ext = cpp_extension.CppExtension("flowkit._C", sources, **kwargs)
    return [ext], {"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = native_extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
