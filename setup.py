"""Build of fastattn: pure Python plus one optional compiled extension, fastattn._cykernels.

The extension is Cython (csrc/*.pyx, *.pxi) over C SIMD kernels (csrc/*.h) with OpenMP.

Environment:
  FASTATTN_PUREPYTHON=1   build no extension at all (pure-Python install; numba/numpy serve)
  FASTATTN_REQUIRE_EXT=1  a failed extension build is an error (wheels, CI); by default it is a
                          warning and the package falls back to the other backends
  FASTATTN_NO_OPENMP=1    do not probe for OpenMP (single-threaded kernels)
"""
import os
import shutil
import sys
import tempfile
import textwrap

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

PUREPYTHON = os.environ.get("FASTATTN_PUREPYTHON", "") == "1"
REQUIRE_EXT = os.environ.get("FASTATTN_REQUIRE_EXT", "") == "1"

# -O3 for the vectorizer; errno and trapping math off so libm calls and compares stay
# vectorizable. Deliberately NOT -ffast-math (gcc < 13 links crtfastmath.o into shared objects
# -> FTZ/DAZ for the whole process; finite-math-only breaks the -inf masks) and NOT
# -march=native (wheels run elsewhere; csrc/fa_kernels.h picks AVX2/AVX-512 copies at run time).
# -Werror=incompatible-pointer-types: the fused op declarations of csrc/common.pxi must reach
# the float table for float and the double table for double (csrc/fa_ops.h)
UNIX_FLAGS = ["-O3", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=fast",
              "-Werror=incompatible-pointer-types"]
MSVC_FLAGS = ["/O2", "/fp:precise"]

OPENMP_PROBE = textwrap.dedent("""
    #include <omp.h>
    int main(void) {
        int n = 0;
        #pragma omp parallel reduction(+:n)
        n += 1;
        return omp_get_max_threads() > 0 && n > 0 ? 0 : 1;
    }
""")


def _openmp_flags(compiler):
    """(compile, link) flags for OpenMP, or None when a tiny OpenMP program won't build."""
    if os.environ.get("FASTATTN_NO_OPENMP", "") == "1":
        return None
    ctype = compiler.compiler_type
    if ctype == "msvc":
        cflags, lflags = ["/openmp"], []
    elif sys.platform == "darwin":          # Apple clang: libomp from Homebrew/conda
        cflags, lflags = ["-Xpreprocessor", "-fopenmp"], ["-lomp"]
    else:
        cflags, lflags = ["-fopenmp"], ["-fopenmp"]
    tmp = tempfile.mkdtemp(prefix="fastattn_omp_")
    try:
        src = os.path.join(tmp, "probe.c")
        with open(src, "w") as f:
            f.write(OPENMP_PROBE)
        objs = compiler.compile([src], output_dir=tmp, extra_postargs=cflags)
        compiler.link_executable(objs, "probe", output_dir=tmp, extra_postargs=lflags or cflags)
        return cflags, lflags
    except Exception:
        return None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class OptionalBuildExt(build_ext):
    """build_ext that probes OpenMP and, unless FASTATTN_REQUIRE_EXT=1, survives a failed build."""

    def build_extensions(self):
        base = MSVC_FLAGS if self.compiler.compiler_type == "msvc" else UNIX_FLAGS
        omp = _openmp_flags(self.compiler)
        if omp is None:
            print("WARNING: fastattn: OpenMP not available; the compiled kernels will run "
                  "single-threaded (python -m fastattn info shows it)", file=sys.stderr)
        for ext in self.extensions:
            ext.extra_compile_args = base + (omp[0] if omp else [])
            ext.extra_link_args = omp[1] if omp else []
        super().build_extensions()

    def run(self):
        try:
            super().run()
        except Exception as exc:     # no compiler at all, etc.
            self._failed(exc)

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:
            self._failed(exc)

    def _failed(self, exc):
        if REQUIRE_EXT:
            raise exc
        print(f"WARNING: fastattn: building the compiled extension failed ({type(exc).__name__}: "
              f"{exc}); installing without it (fa.backends() will say so). Set "
              f"FASTATTN_REQUIRE_EXT=1 to make this an error.", file=sys.stderr)


def extensions():
    if PUREPYTHON:
        return []
    pyx = os.path.join("csrc", "_cykernels.pyx")
    generated = os.path.join("csrc", "_cykernels.c")
    depends = [os.path.join("csrc", f) for f in os.listdir("csrc") if f.endswith((".h", ".pxi"))]
    try:
        from Cython.Build import cythonize
    except ImportError:
        if os.path.exists(generated):           # an sdist ships the generated C
            return [Extension("fastattn._cykernels", [generated], include_dirs=["csrc"], depends=depends)]
        if REQUIRE_EXT:
            raise
        print("WARNING: fastattn: Cython is not available and there is no generated C file; "
              "installing without the compiled extension", file=sys.stderr)
        return []
    ext = Extension("fastattn._cykernels", [pyx], include_dirs=["csrc"], depends=depends)
    return cythonize([ext], compiler_directives={"language_level": 3}, include_path=["csrc"])


setup(ext_modules=extensions(), cmdclass={"build_ext": OptionalBuildExt})
