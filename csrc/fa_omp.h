/*
 * fa_omp.h -- OpenMP shim.  setup.py adds -fopenmp only when a probe program compiles and
 * links with it; without it the Cython prange loops compile to plain serial loops and the
 * module reports OPENMP_ENABLED = False instead of failing to build.
 */
#ifndef FA_OMP_H
#define FA_OMP_H
#ifdef _OPENMP
#include <omp.h>
#define FA_OPENMP_ENABLED 1
static inline int fa_omp_max_threads(void) { return omp_get_max_threads(); }
#else
#define FA_OPENMP_ENABLED 0
static inline int fa_omp_max_threads(void) { return 1; }
#endif
#endif
