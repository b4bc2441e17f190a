"""--mode=kernel of experiments.benchmark: the TwELL inference kernels and ops against the
dense XLA MLP at one (M, density) point, and the whole gated MLP alone for the density
sweep."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from experiments import bench_util as bu
from pallas_kernels import baselines, reference
from pallas_kernels.twell import format as fmt
from pallas_kernels.twell import op as twell_op
from pallas_kernels.twell import pack as pack_mod
from pallas_kernels.twell import t2d as t2d_mod
from twell_jax.synthetic import synthetic_mlp


def _gemm_tflops(m: int, h: int, n: int, n_gemms: int, ms: float) -> float:
    return 2.0 * m * h * n * n_gemms / (ms * 1e-3) / 1e12


@dataclasses.dataclass(frozen=True)
class KernelBench:
    """What every point of --mode=kernel and --mode=tune shares: the MLP's H and N,
    TwELL's compression C, the timing (samples, warm-up calls, back-to-back calls per
    sample) and the synthetic gates' pattern and its sigma."""

    h: int
    n: int
    c: int
    reps: int
    warmup: int
    inner: int
    pattern: str = "uniform"
    sigma: float = 1.0

    @property
    def timing(self) -> dict[str, int]:
        """`bench_util.time_fn`'s warmup, reps and inner."""
        return {"warmup": self.warmup, "reps": self.reps, "inner": self.inner}

    def mlp(self, m: int, nnz: float):
        """(x [M, H], w_gate, w_up, w_down [N, H]) bf16 with ~`nnz` positive gates per row."""
        return synthetic_mlp(m, self.h, self.n, nnz, pattern=self.pattern, sigma=self.sigma)


def kernel_case(m: int, nnz: float, bench: KernelBench) -> dict:
    """One (M, density) point on `bench`'s synthetic gates: every kernel and both MLPs,
    sparse and dense."""
    h, n, c = bench.h, bench.n, bench.c
    reps, warmup, inner = bench.reps, bench.warmup, bench.inner
    x, wg, wu, wd = bench.mlp(m, nnz)
    timed = lambda f, *a: bu.time_fn(f, *a, warmup=warmup, reps=reps, inner=inner)["median_ms"]
    single = lambda f, *a: bu.time_fn(f, *a, warmup=warmup, reps=reps)["median_ms"]

    dense_gated = jax.jit(reference.gated_mlp)
    dense_mlp = jax.jit(reference.mlp)
    gate_gemm = jax.jit(reference.hidden)
    d2t = jax.jit(lambda x, w: baselines.d2t(x, w, compression=c))
    d2t_two_pass = jax.jit(lambda x, w: pack_mod.gate_then_pack(x, w, compression=c))
    pack = jax.jit(lambda g: pack_mod.pack_tiles(g, compression=c))
    gated_t2d = jax.jit(lambda x, p, a, b, d: t2d_mod.t2d(x, p, (a, b, d), compression=c))
    t2d = jax.jit(lambda x, p, b, d: t2d_mod.t2d(x, p, (b, d), compression=c))
    twell_gated = jax.jit(
        lambda *a: twell_op.twell_gated_mlp(*a, compression=c, impl="pallas", return_stats=True)
    )
    twell = jax.jit(
        lambda *a: twell_op.twell_mlp(*a, compression=c, impl="pallas", return_stats=True)
    )

    # The non-gated MLP relu(x Wu^T) Wd takes the sparse weight (wg) as its Wu.
    packed_g = d2t_two_pass(x, wg)
    out_g, stats_g = twell_gated(x, wg, wu, wd)
    out_u, stats_u = twell(x, wg, wd)
    ref_g, ref_u = dense_gated(x, wg, wu, wd), dense_mlp(x, wg, wd)
    # The fused D2T's gate decodes exactly to the dense bf16 relu(x Wg^T) (up to fp32
    # summation order at the ReLU boundary): count mismatching entries.
    decoded = fmt.unpack(d2t(x[:4096], wg), n, c)
    gate_mismatch = int(jnp.sum(decoded != gate_gemm(x[:4096], wg)))

    r = {"M": m, "H": h, "N": n, "C": c, "target_nnz": nnz}
    r["nnz_per_row"] = float(stats_g.nnz_per_row)
    r["max_tile_count"] = int(stats_g.max_tile_count)
    r["overflow_tiles"] = int(stats_g.overflow_tiles)
    r["heavy_rows"] = int(stats_g.heavy_rows)
    r["tail_rows"] = int(stats_g.tail_rows)
    r["d2t_gate_mismatches_first4096"] = gate_mismatch
    r["dense_gated_ms"] = timed(dense_gated, x, wg, wu, wd)
    r["gate_gemm_ms"] = timed(gate_gemm, x, wg)
    r["d2t_ms"] = timed(d2t, x, wg)
    r["d2t_two_pass_ms"] = timed(d2t_two_pass, x, wg)
    r["pack_ms"] = timed(pack, gate_gemm(x, wg))
    r["gated_t2d_ms"] = timed(gated_t2d, x, packed_g, wg, wu, wd)
    r["twell_gated_ms"] = timed(twell_gated, x, wg, wu, wd)
    r["speedup_gated"] = r["dense_gated_ms"] / r["twell_gated_ms"]
    # The two acceptance ratios again, each pair alternating in one loop (drift hits both
    # alike): the median over rounds of the per-round ratio.
    pair = bu.time_interleaved(
        {"dense": dense_gated, "twell": twell_gated}, x, wg, wu, wd, reps=reps, inner=inner
    )
    r["speedup_gated_interleaved"] = pair["ratios"]["dense/twell"]
    pair = bu.time_interleaved(
        {"d2t": d2t_two_pass, "gemm": gate_gemm}, x, wg, reps=reps, inner=inner
    )
    r["d2t_two_pass_over_gemm_interleaved"] = pair["ratios"]["d2t/gemm"]
    # One call per sync: adds the host's dispatch and sync gap to both.
    r["dense_gated_single_call_ms"] = single(dense_gated, x, wg, wu, wd)
    r["twell_gated_single_call_ms"] = single(twell_gated, x, wg, wu, wd)
    r["speedup_gated_single_call"] = (
        r["dense_gated_single_call_ms"] / r["twell_gated_single_call_ms"]
    )
    r["d2t_over_gemm"] = r["d2t_ms"] / r["gate_gemm_ms"]
    r["d2t_two_pass_over_gemm"] = r["d2t_two_pass_ms"] / r["gate_gemm_ms"]
    r["dense_gated_tflops"] = _gemm_tflops(m, h, n, 3, r["dense_gated_ms"])
    r["gate_gemm_tflops"] = _gemm_tflops(m, h, n, 1, r["gate_gemm_ms"])
    r["twell_gated_tokens_per_ms"] = m / r["twell_gated_ms"]
    r["dense_gated_tokens_per_ms"] = m / r["dense_gated_ms"]
    r.update({f"gated_{k}": v for k, v in bu.errors(out_g, ref_g).items()})

    r["nnz_per_row_nongated"] = float(stats_u.nnz_per_row)
    r["overflow_tiles_nongated"] = int(stats_u.overflow_tiles)
    r["dense_mlp_ms"] = timed(dense_mlp, x, wg, wd)
    r["t2d_ms"] = timed(t2d, x, packed_g, wg, wd)
    r["twell_mlp_ms"] = timed(twell, x, wg, wd)
    r["speedup_nongated"] = r["dense_mlp_ms"] / r["twell_mlp_ms"]
    r.update({f"nongated_{k}": v for k, v in bu.errors(out_u, ref_u).items()})
    return r


def sweep_case(m: int, nnz: float, bench: KernelBench) -> dict:
    """Whole gated MLP only, for the density crossover."""
    c = bench.c
    x, wg, wu, wd = bench.mlp(m, nnz)
    twell_gated = jax.jit(
        lambda *a: twell_op.twell_gated_mlp(*a, compression=c, impl="pallas", return_stats=True)
    )
    _, stats = twell_gated(x, wg, wu, wd)
    timing = bench.timing
    dense = bu.time_fn(jax.jit(reference.gated_mlp), x, wg, wu, wd, **timing)
    sparse = bu.time_fn(twell_gated, x, wg, wu, wd, **timing)
    return {
        "M": m,
        "C": c,
        "target_nnz": nnz,
        "nnz_per_row": float(stats.nnz_per_row),
        "overflow_tiles": int(stats.overflow_tiles),
        "dense_gated_ms": dense["median_ms"],
        "twell_gated_ms": sparse["median_ms"],
        "speedup_gated": dense["median_ms"] / sparse["median_ms"],
    }
