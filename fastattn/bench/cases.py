"""What the benchmark measures: the cases, grouped in sweeps, and the presets that pick them.

A case is one shape and one operation. Sweeps vary one size (L for forward and backward, the
KV length S for decode) so that the plots can draw a line per implementation. The FLOP and byte
counts here are the ones every figure is normalized by, so they live next to the shapes.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Case:
    sweep: str            # the line this case belongs to, e.g. "fwd d=64"
    kind: str             # "fwd" (forward; decode is a forward with L=1) or "bwd"
    B: int
    Hq: int
    Hkv: int
    L: int                # query length
    S: int                # key/value length
    D: int                # head dim (of q, k and v)
    causal: bool = False

    @property
    def name(self) -> str:
        size = f"S={self.S}" if self.is_decode else f"L={self.L}"
        return f"{self.sweep} {size}"

    @property
    def is_decode(self) -> bool:
        return self.L == 1 and self.S > 1

    @property
    def x(self) -> int:
        """The swept size: S for decode, L otherwise."""
        return self.S if self.is_decode else self.L

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Case":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__})


def flops(case: Case) -> float:
    """Forward 4·B·H·L·S·D (two GEMMs); causal counts half; backward 2.5× (FlashAttention's)."""
    f = 4.0 * case.B * case.Hq * case.L * case.S * case.D
    if case.causal and case.L > 1:
        f /= 2
    return f * 2.5 if case.kind == "bwd" else f


def min_bytes(case: Case) -> float:
    """Bytes that must cross the memory bus at least once (float32): q, k, v in, out back.

    Meaningful for decode, where reading K and V is the whole cost; for long forward passes the
    GEMMs dominate and this is far from the bound.
    """
    q_out = 2 * case.B * case.Hq * case.L * case.D
    kv = 2 * case.B * case.Hkv * case.S * case.D
    return 4.0 * (q_out + kv) * (2 if case.kind == "bwd" else 1)


def seed_bytes(case: Case) -> int:
    """Peak of the seed-style dense NumPy code, float32: it materializes (B, Hq, L, S) scores.

    Forward: scores, their exp and the normalized weights are alive at once (3 copies).
    Backward: the saved weights P, dP and dS (3 copies) plus a temporary (1).
    Both also repeat K and V over the query heads of a group (GQA), as the seed code has no GQA.
    """
    scores = 4 * case.B * case.Hq * case.L * case.S
    kv_repeated = 2 * 4 * case.B * case.Hq * case.S * case.D if case.Hq != case.Hkv else 0
    return (4 if case.kind == "bwd" else 3) * scores + kv_repeated


def _sweep(sweep: str, kind: str, sizes, *, B=1, Hq=4, Hkv=None, D=64, causal=False,
           decode=False) -> list[Case]:
    Hkv = Hq if Hkv is None else Hkv
    if decode:
        return [Case(sweep, kind, B, Hq, Hkv, 1, s, D, causal) for s in sizes]
    return [Case(sweep, kind, B, Hq, Hkv, n, n, D, causal) for n in sizes]


# Decode in the style of an 8B model's layer: 32 query heads sharing 8 KV heads, d=128, one query.
def _decode(sizes) -> list[Case]:
    return _sweep("decode GQA 32/8 d=128", "fwd", sizes, Hq=32, Hkv=8, D=128, decode=True)


@dataclass(frozen=True)
class Preset:
    name: str
    cases: tuple
    rounds: int           # interleaved rounds: one process per implementation per case per round
    min_time: float       # seconds of timed calls per process (at least one call)
    # cap on timed calls per process.  The record's presets let min_time decide: with a cap
    # of 10, a 0.6 ms call was timed for 6 ms right after its process started, and the
    # per-round ratio of fwd d=64 L=256 read 0.84, 1.08, 0.75, 0.94 in four rounds where 0.5 s
    # of calls read 0.99 in all four (torch's first calls in a process vary most).
    max_repeats: int
    timeout: float        # seconds per process, then the run is recorded as timed out
    out_dir: str          # where results go by default
    # runs of the sgemm/bandwidth probes before and after the cases: the machine's rates while
    # the cases ran, not just at the start
    probes: tuple = (1, 0)
    budget_min: float = 0  # past this many minutes, runs not yet made are recorded as skipped
    note: str = ""


# The speed bars the compiled-backend issues set (numba, cython): one case each, not a line to plot.
TARGET = "target"


def _targets(long_context: bool) -> list[Case]:
    cases = [Case(f"{TARGET} fwd B=1 H=8 d=64", "fwd", 1, 8, 8, 2048, 2048, 64),
             Case(f"{TARGET} fwd B=1 H=8 d=64 causal", "fwd", 1, 8, 8, 2048, 2048, 64, True),
             Case(f"{TARGET} fwd B=1 H=8 d=128", "fwd", 1, 8, 8, 2048, 2048, 128),
             Case(f"{TARGET} fwd B=4 H=8 d=64", "fwd", 4, 8, 8, 256, 256, 64),
             Case(f"{TARGET} bwd B=1 H=8 d=64", "bwd", 1, 8, 8, 1024, 1024, 64),
             Case(f"{TARGET} bwd B=1 H=8 d=64 causal", "bwd", 1, 8, 8, 1024, 1024, 64, True)]
    if long_context:       # ~0.55 TFLOP per call: too long for the full preset's half hour
        cases += [Case(f"{TARGET} decode GQA 32/8 d=128", "fwd", 1, 32, 8, 1, 16384, 128),
                  Case(f"{TARGET} fwd H=4 d=64 causal", "fwd", 1, 4, 4, 32768, 32768, 64, True),
                  # the backward issue's memory bar: O(L*d), shown at L = S = 16384
                  Case(f"{TARGET} bwd H=1 d=64", "bwd", 1, 1, 1, 16384, 16384, 64)]
    return cases


# H=4 (not 8 or 32) for the long forward sweeps: it keeps L=16384 at ~0.3 TFLOP per call, so the
# full preset fits in half an hour on 2 cores, and 4 heads still give every thread work.
_FULL_L = (256, 1024, 2048, 4096, 8192, 16384)

PRESETS = {
    "smoke": Preset(
        "smoke",
        tuple(_sweep("fwd d=32", "fwd", (64,), Hq=2, D=32)
              + _sweep("decode GQA 4/2 d=32", "fwd", (128,), Hq=4, Hkv=2, D=32, decode=True)
              + _sweep("bwd d=32", "bwd", (32,), Hq=2, D=32)),
        rounds=1, min_time=0.0, max_repeats=2, timeout=120.0,
        out_dir="bench/out",
        note="tiny shapes that only check the machinery (the test suite runs it)"),
    "quick": Preset(
        "quick",
        tuple(_sweep("fwd d=64", "fwd", (1024,))
              + _sweep("fwd d=64 causal", "fwd", (1024,), causal=True)
              + _decode((8192,))
              + _sweep("bwd d=64", "bwd", (512,))),
        rounds=2, min_time=0.1, max_repeats=3, timeout=60.0,
        out_dir="bench/out",
        note="a first look in about a minute (about two on the first run, while numba "
             "compiles its kernels); use --preset full for the record"),
    "full": Preset(
        "full",
        tuple(_sweep("fwd d=64", "fwd", _FULL_L)
              + _sweep("fwd d=64 causal", "fwd", (256, 1024, 4096, 16384), causal=True)
              + _sweep("fwd d=128", "fwd", (512, 2048, 8192), D=128)
              + _sweep("fwd GQA 8/2 d=128", "fwd", (1024, 4096), Hq=8, Hkv=2, D=128)
              + _decode((1024, 4096, 16384, 65536))
              + _sweep("bwd d=64", "bwd", (1024, 2048, 4096))
              + _sweep("bwd d=64 causal", "bwd", (1024, 4096), causal=True)
              + _targets(long_context=False)),
        rounds=3, min_time=0.5, max_repeats=1000, timeout=300.0, out_dir="bench/results",
        budget_min=28, probes=(2, 1),
        note="the record: README's table and plots (~25 min)"),
    "targets": Preset(
        "targets", tuple(_targets(long_context=True)),
        rounds=3, min_time=1.0, max_repeats=1000, timeout=600.0, out_dir="bench/out",
        probes=(2, 1), note="the speed bars of the numba and cython issues, 32k context included"),
}
