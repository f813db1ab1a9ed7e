"""Builds the native core (native/) into offload._native.

Instruction-set variants are selected per function with GCC target attributes inside the
sources, so the whole extension compiles with portable flags (no host-specific -march) and the
fastest kernel is chosen at load time from CPUID.
"""
import glob

from pybind11.setup_helpers import Pybind11Extension, ParallelCompile
from setuptools import setup

ParallelCompile("OFFLOAD_BUILD_JOBS", default=2).install()

sources = sorted(glob.glob("native/**/*.cpp", recursive=True))

native = Pybind11Extension(
    "offload._native",
    sources=sources,
    include_dirs=["native"],
    cxx_std=17,
    # -fno-math-errno: sqrtf would otherwise stop vectorization of the Adam loop.
    extra_compile_args=["-O3", "-fno-math-errno", "-fno-trapping-math", "-Wall", "-Wextra"],
    libraries=["pthread"],
)

setup(ext_modules=[native])
