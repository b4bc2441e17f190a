"""Launch sweeps of the inference kernels (`python -m experiments.benchmark --mode=tune`):
the pack kernel, the fused D2T baseline and GatedT2D's SDDMM and SpMM, each launch
timed on the same synthetic gated MLP; a launch that fails to compile is a result."""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
from absl import logging

from experiments import bench_util as bu
from experiments.benchmark_kernel import KernelBench
from pallas_kernels import baselines, reference
from pallas_kernels._gather import RowLaunch
from pallas_kernels.twell import pack as pack_mod
from pallas_kernels.twell import t2d as t2d_mod
from pallas_kernels.twell.config import PackConfig, T2DConfig


def _ints(spec: str) -> tuple[int, ...]:
    return tuple(int(v) for v in spec.split(","))


def _t2d_launches(spec: str) -> T2DConfig:
    """ "g,w,bh:g,w,bh" (SDDMM, SpMM) -> T2DConfig."""
    parts = spec.split(":")
    if len(parts) != 2 or any(len(_ints(p)) != 3 for p in parts):
        raise ValueError("want <g,w,bh>:<g,w,bh>, each three integers")
    sddmm, spmm = (RowLaunch(*_ints(p)) for p in parts)
    return T2DConfig(sddmm=sddmm, spmm=spmm)


def launch_configs(d2t_specs, pack_specs, t2d_specs) -> tuple[list, list, list]:
    """The --tune_d2t_cfg, --tune_pack_cfg and --tune_t2d_cfg strings as launch configs
    (checked before anything is timed).

    Raises:
      ValueError: a spec that is not integers of the launch's arity, naming its flag.
    """

    def parse(flag, spec, make):
        try:
            return make(spec)
        except (TypeError, ValueError) as e:
            raise ValueError(f"--{flag}={spec}: {e}") from None

    return (
        [parse("tune_d2t_cfg", s, lambda s: baselines.D2TConfig(*_ints(s))) for s in d2t_specs],
        [parse("tune_pack_cfg", s, lambda s: PackConfig(*_ints(s))) for s in pack_specs],
        [parse("tune_t2d_cfg", s, _t2d_launches) for s in t2d_specs],
    )


def _time_configs(kind: str, cfgs, make_fn, args, warmup: int, reps: int, inner: int) -> list[dict]:
    """Median ms of `make_fn(cfg)(*args)` for each config; a failed compile is a result."""
    rows = []
    for cfg in cfgs:
        try:
            fn = jax.jit(make_fn(cfg))
            t = bu.time_fn(fn, *args, warmup=warmup, reps=reps, inner=inner)["median_ms"]
        except Exception as e:
            t = None
            logging.warning("%s %s failed: %s", kind, cfg, str(e)[:300])
        rows.append({"cfg": dataclasses.asdict(cfg), "ms": t})
        print(json.dumps({"kind": kind, **rows[-1]}), flush=True)
    return rows


def tune(m: int, bench: KernelBench, *, d2t_specs, pack_specs, t2d_specs) -> dict:
    """Launches of the pack kernel, the fused D2T baseline and GatedT2D at ~29 nnz per row
    of `bench`'s synthetic gates.

    The specs are --tune_d2t_cfg, --tune_pack_cfg and --tune_t2d_cfg strings.
    """
    c = bench.c
    d2t_cfgs, pack_cfgs, t2d_cfgs = launch_configs(d2t_specs, pack_specs, t2d_specs)
    x, wg, wu, wd = bench.mlp(m, 29)
    timing = bench.timing
    gate = jax.jit(reference.hidden)
    gemm_ms = bu.time_fn(gate, x, wg, **timing)["median_ms"]
    timed = functools.partial(_time_configs, **timing)
    d2t_rows = timed(
        "d2t",
        d2t_cfgs,
        lambda cfg: lambda x, w: baselines.d2t(x, w, compression=c, cfg=cfg),
        (x, wg),
    )
    for row in d2t_rows:
        row["over_gemm"] = row["ms"] and row["ms"] / gemm_ms
    pack_rows = timed(
        "pack",
        pack_cfgs,
        lambda cfg: lambda g: pack_mod.pack_tiles(g, compression=c, cfg=cfg),
        (gate(x, wg),),
    )
    packed = jax.jit(lambda x, w: pack_mod.gate_then_pack(x, w, compression=c))(x, wg)
    t2d_rows = timed(
        "t2d",
        t2d_cfgs,
        lambda cfg: lambda x, p, a, b, d: t2d_mod.t2d(x, p, (a, b, d), compression=c, cfg=cfg),
        (x, packed, wg, wu, wd),
    )
    return {
        "M": m,
        "gate_gemm_ms": gemm_ms,
        "d2t": d2t_rows,
        "pack": pack_rows,
        "gated_t2d": t2d_rows,
    }
