"""Train state, optimizer and the jitted train / eval steps.

One code path for 1 CPU, N simulated CPUs, 1 GPU and many GPUs: the state and the
batches are laid out on a `twell_jax.sharding` mesh (FSDP parameters, batch split
over every device).

Typical use (what `twell_jax.trainer` does):

    mesh = sharding.make_mesh(*cfg.mesh_shape)
    state = create_train_state(cfg, mesh)
    train_step = make_train_step(cfg, mesh)
    eval_step = make_eval_step(cfg, mesh)
    for batch in batches:                    # {"inputs", "targets"}: int32 [B, S]
        state, metrics = train_step(state, batch)
    val_ce = eval_step(state.params, val_batch)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from twell_jax import lm_loss, sparsity
from twell_jax.config import ModelConfig, OptimConfig, TrainConfig
from twell_jax.ffn import SPARSE_COUNTERS
from twell_jax.model import Transformer
from twell_jax.sharding import BATCH_AXES, batch_sharding, tree_shardings, with_mesh

Batch = dict[str, jax.Array]
Params = dict[str, Any]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """Everything a training run carries from step to step (a pytree; checkpoint it whole).

    Attributes:
      step: int32 scalar, optimizer steps taken.
      params: pure-dict parameters (see `twell_jax.model.Transformer`), fp32.
      opt_state: optax state of `make_optimizer`.
      tokens_since_fired: [L, N] int32 dead-neuron counters (`twell_jax.sparsity`).
      use_sparse: [L] bool, which layers run the sparse kernels (ffn_impl="sparse").
    """

    step: jax.Array
    params: Params
    opt_state: optax.OptState
    tokens_since_fired: jax.Array
    use_sparse: jax.Array


def lr_schedule(cfg: OptimConfig) -> optax.Schedule:
    """Linear warmup 0 -> lr over warmup_steps, cosine to 0 at total_steps."""
    return optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, cfg.warmup_steps, cfg.total_steps, end_value=0.0
    )


def _decay_mask(params: Params) -> Any:
    """Weight decay on everything but norm scales (HF default, as the paper)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: not any(str(getattr(k, "key", "")).endswith("norm") for k in path),
        params,
    )


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    """Global-norm clipping then AdamW on `lr_schedule(cfg)`."""
    b1, b2 = cfg.betas
    return optax.chain(
        optax.clip_by_global_norm(cfg.clip_norm),
        optax.adamw(
            lr_schedule(cfg),
            b1=b1,
            b2=b2,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            mask=_decay_mask,
        ),
    )


def _schedule_count(opt_state: Any) -> jax.Array:
    """The step the optimizer's LR schedule is at: the step count, less the steps
    skipped as non-finite (their optimizer state is the previous one)."""
    return optax.tree_utils.tree_get(
        opt_state, "count", filtering=lambda path, _: path[-1].tuple_name == "ScaleByScheduleState"
    )


def model_graphdef(cfg: ModelConfig) -> nnx.GraphDef:
    """Static structure of `Transformer(cfg)`: `nnx.merge(model_graphdef(cfg), params)`.

    The parameter tree is the same for every ffn_impl, so trained params can be merged
    into a graphdef with ffn_impl="twell" for inference.
    """
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    return nnx.split(abstract)[0]


def _init_params(model_cfg: ModelConfig, rng: jax.Array) -> Params:
    model = Transformer(model_cfg, rngs=nnx.Rngs(params=rng))
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _state_from_params(cfg: TrainConfig, params: Params) -> TrainState:
    m = cfg.model
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=make_optimizer(cfg.optim).init(params),
        tokens_since_fired=sparsity.init_tokens_since_fired(m.n_layers, m.d_ff),
        # Layers start dense; the l0-cutoff switch turns them sparse (docs/design.md §7).
        use_sparse=jnp.zeros((m.n_layers,), bool),
    )


def _abstract_state(cfg: TrainConfig) -> TrainState:
    params = jax.eval_shape(functools.partial(_init_params, cfg.model), jax.random.key(0))
    return jax.eval_shape(lambda p: _state_from_params(cfg, p), params)


@functools.cache
def _params_initializer(model_cfg: ModelConfig, mesh: Mesh) -> Callable:
    """Jitted sharded parameter init, one per (model, mesh): its compile is the slow part."""
    init = functools.partial(_init_params, model_cfg)
    abstract = jax.eval_shape(init, jax.random.key(0))
    return jax.jit(init, out_shardings=tree_shardings(abstract, mesh))


def train_state_shardings(cfg: TrainConfig, mesh: Mesh) -> TrainState:
    """NamedSharding of every TrainState leaf (for jit and checkpoint restore).

    Parameters and optimizer state follow `sharding.param_spec`; the small bookkeeping arrays
    (step, dead-neuron counters, sparse switch) are replicated.
    """
    abstract = _abstract_state(cfg)
    replicated = NamedSharding(mesh, P())
    return dataclasses.replace(
        jax.tree.map(lambda _: replicated, abstract),
        params=tree_shardings(abstract.params, mesh),
        opt_state=tree_shardings(abstract.opt_state, mesh),
    )


def abstract_train_state(cfg: TrainConfig, mesh: Mesh) -> TrainState:
    """TrainState of `jax.ShapeDtypeStruct`s with shardings: an Orbax restore target."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        _abstract_state(cfg),
        train_state_shardings(cfg, mesh),
    )


def create_train_state(cfg: TrainConfig, mesh: Mesh, rng: jax.Array | None = None) -> TrainState:
    """Initialises parameters and optimizer state directly in their sharded layout.

    Args:
      cfg: the run config.
      mesh: from `sharding.make_mesh`.
      rng: parameter-init key; defaults to `jax.random.key(cfg.seed)`.
    """
    rng = jax.random.key(cfg.seed) if rng is None else rng
    params = _params_initializer(cfg.model, mesh)(rng)
    # The initializer's own tree: no shape check, and its buffers can be reused.
    return _complete_state(cfg, mesh, params, donate=True)


def train_state_from_params(
    cfg: TrainConfig, mesh: Mesh, params: Params, *, donate: bool = False
) -> TrainState:
    """A fresh TrainState (step 0, new optimizer state) around given parameters.

    Args:
      cfg: the run config; `params` must have `Transformer(cfg.model)`'s tree.
      mesh: from `sharding.make_mesh`.
      params: pure-dict parameters of any float dtype; cast to fp32 (the master copy)
        and laid out by `sharding.param_spec`.
      donate: let the state reuse `params`' buffers (they are invalid afterwards).

    Raises:
      ValueError: `params` differs from the model's parameter tree or shapes.
    """
    _check_param_shapes(params, _abstract_state(cfg).params)
    return _complete_state(cfg, mesh, params, donate)


def _complete_state(cfg: TrainConfig, mesh: Mesh, params: Params, donate: bool) -> TrainState:
    """`_state_from_params` jitted into the state's shardings, params cast to fp32."""
    complete = jax.jit(
        lambda p: _state_from_params(cfg, jax.tree.map(lambda a: a.astype(jnp.float32), p)),
        out_shardings=train_state_shardings(cfg, mesh),
        donate_argnums=0 if donate else (),
    )
    return complete(params)


def _check_param_shapes(params: Params, expected: Params) -> None:
    """Raises ValueError naming the first parameter missing, extra or of another shape."""

    def shapes(tree):
        flat = jax.tree_util.tree_flatten_with_path(tree)[0]
        return {jax.tree_util.keystr(k): tuple(v.shape) for k, v in flat}

    got, want = shapes(params), shapes(expected)
    for name in sorted(set(got) | set(want)):
        if got.get(name) != want.get(name):
            raise ValueError(
                f"params{name}: shape {got.get(name, 'missing')}, the model expects "
                f"{want.get(name, 'no such parameter')}"
            )


def _microbatches(x: jax.Array, n: int) -> jax.Array:
    """[B, S] -> [n, B / n, S], keeping each device's rows on that device.

    Row r goes to micro-batch r % n: a contiguous per-device block of B rows stays a
    contiguous block of B / n rows in every micro-batch.
    """
    b, s = x.shape
    x = x.reshape(b // n, n, s).swapaxes(0, 1)
    return jax.lax.with_sharding_constraint(x, P(None, BATCH_AXES))


def check_batch_split(cfg: TrainConfig, mesh: Mesh) -> None:
    """Raises ValueError unless each micro-batch splits evenly over the mesh's devices
    (`make_train_step` needs it; a run checks it before writing anything)."""
    micro_batch = cfg.batch_size // cfg.optim.grad_accum_steps
    if micro_batch % mesh.size:
        raise ValueError(
            f"TrainConfig.batch_size={cfg.batch_size}: micro-batches of {micro_batch} "
            f"sequences (grad_accum_steps={cfg.optim.grad_accum_steps}) must split evenly "
            f"over the {mesh.size} devices of the mesh: make it a multiple of "
            f"{cfg.optim.grad_accum_steps * mesh.size}"
        )


def make_train_step(
    cfg: TrainConfig, mesh: Mesh, *, skip_nonfinite: bool = False
) -> Callable[[TrainState, Batch], tuple[TrainState, dict[str, jax.Array]]]:
    """Builds the jitted optimizer step (the input state is donated).

    One call: `optim.grad_accum_steps` micro-batches scanned inside the jit (gradients
    averaged in fp32), AdamW update, dead-neuron counters, optional dead-row re-init
    every `sparsity.reinit_dead_every` steps, and the per-layer sparse switch every
    `sparsity.sparse_recheck_every` steps (ffn_impl="sparse").

    Args:
      cfg: the run config.
      mesh: from `sharding.make_mesh`.
      skip_nonfinite: a step whose loss or gradient norm is not finite returns the
        state it was given but for the step counter (parameters, optimizer state,
        dead-neuron counters and sparse switch unchanged), chosen on the device.

    Returns:
      `step(state, batch) -> (state, metrics)`, batch {"inputs", "targets"} int32 [B, S]
      with B = cfg.batch_size. Metrics (device arrays; `jax.device_get` them):
      scalars loss, ce, l1_loss (lambda * L1 term), l1_coef, grad_norm (before
      clipping), lr; per layer [L]: l1, l0, sparsity (1 - l0/N), alive, use_sparse,
      and with ffn_impl="sparse" what the switch reads besides l0 (hot_share, tail_load:
      fp32, `sparsity.next_use_sparse`) and the int32 overflow counters tail_rows,
      dense_fallback.

    Raises:
      ValueError: ffn_impl="twell" (inference kernels have no gradient), or a
        micro-batch that does not split evenly over the mesh.
    """
    if cfg.model.ffn_impl == "twell":
        raise ValueError(
            "ModelConfig.ffn_impl='twell' is inference-only: train with 'dense' or 'sparse'"
        )
    check_batch_split(cfg, mesh)
    graphdef = model_graphdef(cfg.model)
    optimizer = make_optimizer(cfg.optim)
    schedule = lr_schedule(cfg.optim)
    sp = cfg.sparsity
    n_micro = cfg.optim.grad_accum_steps
    state_shardings = train_state_shardings(cfg, mesh)
    param_shardings = state_shardings.params

    def loss_fn(params, batch, use_sparse, step):
        model = nnx.merge(graphdef, params)
        x, stats = model.hidden_states(batch["inputs"], use_sparse)
        ce = lm_loss.cross_entropy(x, model.head_weight(), batch["targets"], cfg.ce_chunk_tokens)
        l1_loss = sparsity.l1_penalty(stats["l1"], params, step, sp)
        return ce + l1_loss, (ce, l1_loss, stats)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def step_fn(state: TrainState, batch: Batch):
        def micro_step(grads_sum, micro_batch):
            (loss, aux), grads = grad_fn(state.params, micro_batch, state.use_sparse, state.step)
            grads_sum = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grads_sum, grads)
            return grads_sum, (loss, *aux)

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)
        # Accumulate in the parameter layout: one reduce-scatter per micro-batch, and the
        # fp32 accumulator is sharded like the parameters.
        zeros = jax.lax.with_sharding_constraint(zeros, param_shardings)
        micro = jax.tree.map(lambda x: _microbatches(x, n_micro), batch)
        grads, (loss, ce, l1_loss, stats) = jax.lax.scan(micro_step, zeros, micro)
        grads = jax.tree.map(lambda g: g / n_micro, grads)
        # The optimizer update then runs on the shards, like the parameters it updates.
        grads = jax.lax.with_sharding_constraint(grads, param_shardings)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)

        l0 = stats["l0"].mean(axis=0)
        fired = stats["fired"].any(axis=0)
        tokens_since_fired = sparsity.update_tokens_since_fired(
            state.tokens_since_fired, fired, cfg.tokens_per_step
        )
        alive = sparsity.alive_fraction(tokens_since_fired, cfg.tokens_until_dead)
        next_step = state.step + 1
        if sp.reinit_dead_every:
            params, tokens_since_fired = jax.lax.cond(
                next_step % sp.reinit_dead_every == 0,
                lambda p, t: sparsity.reinit_dead_rows(
                    p,
                    t,
                    jax.random.fold_in(jax.random.key(cfg.seed), next_step),
                    cfg.model,
                    cfg.tokens_until_dead,
                ),
                lambda p, t: (p, t),
                params,
                tokens_since_fired,
            )
        use_sparse, switch_stats = state.use_sparse, {}
        if cfg.model.ffn_impl == "sparse":
            # What the switch reads besides l0 (the tail of the worst micro-batch).
            switch_stats = {
                "hot_share": stats["hot_share"].mean(axis=0),
                "tail_load": stats["tail_load"].max(axis=0),
            }
            use_sparse = sparsity.next_use_sparse(
                state.step, l0, *switch_stats.values(), use_sparse, sp
            )
        new_state = TrainState(next_step, params, opt_state, tokens_since_fired, use_sparse)
        if skip_nonfinite:
            finite = jnp.isfinite(loss.mean()) & jnp.isfinite(optax.tree.norm(grads))
            kept = dataclasses.replace(state, step=next_step)
            new_state = jax.tree.map(lambda n, k: jnp.where(finite, n, k), new_state, kept)
        metrics = {
            "loss": loss.mean(),
            "ce": ce.mean(),
            "l1_loss": l1_loss.mean(),
            "l1_coef": sparsity.l1_coef_at(state.step, sp),
            "grad_norm": optax.tree.norm(grads),
            "lr": schedule(_schedule_count(state.opt_state)),
            "l1": stats["l1"].mean(axis=0),
            "l0": l0,
            "sparsity": sparsity.sparsity_fraction(l0, cfg.model.d_ff),
            "alive": alive,
            "use_sparse": state.use_sparse,
            **switch_stats,
            # Sparse-op overflow counters, summed over micro-batches.
            **{k: stats[k].sum(axis=0) for k in SPARSE_COUNTERS if k in stats},
        }
        return new_state, metrics

    jitted = jax.jit(
        step_fn,
        in_shardings=(state_shardings, batch_sharding(mesh)),
        out_shardings=(state_shardings, NamedSharding(mesh, P())),
        donate_argnums=0,
    )
    return with_mesh(jitted, mesh)


def make_eval_step(cfg: TrainConfig, mesh: Mesh) -> Callable[[Params, Batch], jax.Array]:
    """Builds the jitted validation step: `eval_step(params, batch) -> mean CE` (fp32 scalar).

    The batch runs as the train step's `optim.grad_accum_steps` micro-batches, one after
    another, so validation fits wherever a train step does. ffn_impl="sparse" evaluates
    through the dense path (same function; the sparse kernels exist for their backward
    pass). "twell" evaluates the inference kernels.
    """
    model_cfg = cfg.model
    if model_cfg.ffn_impl == "sparse":
        model_cfg = dataclasses.replace(model_cfg, ffn_impl="dense")
    graphdef = model_graphdef(model_cfg)
    n_micro = cfg.optim.grad_accum_steps

    def micro_ce(params, batch):
        model = nnx.merge(graphdef, params)
        x, _ = model.hidden_states(batch["inputs"])
        return lm_loss.cross_entropy(x, model.head_weight(), batch["targets"], cfg.ce_chunk_tokens)

    def eval_fn(params, batch):
        if n_micro == 1:
            return micro_ce(params, batch)
        micro = jax.tree.map(lambda x: _microbatches(x, n_micro), batch)
        # Micro-batches of equal token counts: the mean of their means is the batch's.
        return jnp.mean(jax.lax.map(functools.partial(micro_ce, params), micro))

    jitted = jax.jit(
        eval_fn,
        in_shardings=(train_state_shardings(cfg, mesh).params, batch_sharding(mesh)),
        out_shardings=NamedSharding(mesh, P()),
    )
    return with_mesh(jitted, mesh)


def host_metrics(metrics: dict[str, jax.Array]) -> dict[str, float | np.ndarray]:
    """Device metrics -> Python floats (scalars) and numpy arrays (per layer)."""
    return {
        k: (float(v) if np.ndim(v) == 0 else np.asarray(v))
        for k, v in jax.device_get(metrics).items()
    }
