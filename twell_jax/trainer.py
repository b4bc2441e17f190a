"""The pre-training loop: resume, train, eval, checkpoint (`experiments/pretrain.py` runs it).

`run(cfg, opts)` does everything after the config is resolved:

1. checks the run before touching the workdir (`check_run`): reads the prepared corpus
   (`twell_jax.corpus`, `twell_jax.input_pipeline`), builds the mesh, and refuses a
   mesh that does not fit the devices, a micro-batch that does not split over it, a
   config whose train step clearly cannot fit in memory (`twell_jax.step_memory`) and
   a train split without one batch;
2. takes the workdir lock (`twell_jax.run_guards.WorkdirLock`: `<workdir>/run.lock`,
   holding host and pid; a second run on the same workdir is refused with
   `WorkdirLockedError`), and builds the train state and the data iterator;
3. restores the newest checkpoint of `<workdir>/checkpoints` if there is one (train
   state, data-iterator position; a different saved config is a `ConfigMismatchError`,
   a different `optim.total_steps` a `ScheduleChangeError` unless
   `opts.allow_schedule_change`). Every check runs before anything is written:
   `config.json` and `metrics.jsonl` are only (re)written once the resume is accepted;
4. trains to `cfg.optim.total_steps` (or `opts.stop_at`), logging a progress line (with
   the elapsed time and the ETA of `twell_jax.progress`) and a `metrics.jsonl` record
   every `log_every` steps, evaluating the val CE every `eval_every` steps (and
   re-plotting `metrics.png`), and saving asynchronous checkpoints every
   `checkpoint_every` steps and at the end;
5. checks that the loss and gradient norm of every step are finite (at each log,
   eval and save, so the loop is not synchronised every step) and that the state is
   finite before each save: a non-finite value raises `DivergenceError` without
   saving, so the checkpoints on disk are the last good ones. With
   `opts.skip_nonfinite=K` the step itself keeps the state of a non-finite step (on the
   device), and the loop counts and logs up to K of them before it raises;
6. on SIGINT / SIGTERM finishes the current step, saves a checkpoint and returns
   (`summary["interrupted"]`, `summary["signal"]`), so that re-running the same
   command resumes. A second Ctrl-C aborts without saving.

Every process runs the same loop (multi-host: each reads its share of the batch and
`jax.make_array_from_process_local_data` assembles the global batch); only process 0
writes metrics and plots, all processes take part in checkpointing.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from absl import logging

from twell_jax import (
    checkpoint,
    corpus,
    energy,
    input_pipeline,
    metrics,
    progress,
    run_data,
    sharding,
    step_memory,
    switch_cost,
    train,
)
from twell_jax.config import TrainConfig
from twell_jax.config_io import config_to_dict
from twell_jax.hf import init as hf_init
from twell_jax.run_guards import (
    DivergenceError,
    ResumeRefusedError,
    StopRequest,
    WorkdirLock,
    all_finite,
    check_schedule,
)
from twell_jax.run_options import RunOptions

CHECKPOINT_DIR = "checkpoints"
CONFIG_FILE = "config.json"
# Per-step scalars that must stay finite (the divergence guard).
FINITE_METRICS = ("loss", "grad_norm")
# Key of the checkpoint's data item that carries the run's skipped-step count (beside
# the data iterator's own state).
SKIPPED_KEY = "skipped_steps"
# Config keys that may change between a checkpoint and its resumption, on top of the
# checkpointer's defaults (step counts, cadences): restore reshards onto any mesh, and
# neither remat (nor what it saves), the micro-batching of the same batch nor the
# inference-only TwELL compression changes the training numbers (a run moved to fewer
# devices may need more micro-batches, which the memory check suggests).
# Keys that change speed or memory, not the function trained (both switch branches
# compute the same FFN).
RESUME_IGNORE_KEYS = (
    *checkpoint.DEFAULT_IGNORE_KEYS,
    *("mesh_shape", "remat", "sparse_save_residuals", "twell_compression"),
    "grad_accum_steps",
    *("sparse_switch", "sparse_l0_cutoff", "sparse_hot_shift"),
)


# What `check_run` read and built: the corpus's meta, the mesh, the step's memory need.
Checked = tuple[dict[str, Any], jax.sharding.Mesh, step_memory.StepMemory]


def _data_config(cfg: TrainConfig, data_dir: str) -> input_pipeline.DataConfig:
    return input_pipeline.DataConfig(
        data_dir, seq_len=cfg.model.seq_len, batch_size=cfg.batch_size, seed=cfg.seed
    )


def check_run(cfg: TrainConfig, data_dir: str) -> Checked:
    """The checks of a run that need no workdir, so that `run` (and a CLI before it)
    refuses a bad config before anything is written: the corpus is prepared and fits the
    vocabulary, the mesh fits the devices, the micro-batch splits over it, one train step
    fits in memory, the train split holds a batch and the validation shards are whole (a
    split too small for a batch only turns validation off, `run_data.Evaluator`).

    Raises:
      FileNotFoundError: `data_dir` is not a prepared corpus, or a shard is missing.
      ValueError: naming what does not fit (`StepMemoryError` for the memory), or a
        shard whose size is not meta.json's.
    """
    meta = corpus.load_meta(data_dir)
    corpus.open_shards(data_dir, "val", meta)
    run_data.check_vocab(cfg, meta, data_dir)
    mesh = sharding.make_mesh(*cfg.mesh_shape)
    train.check_batch_split(cfg, mesh)
    need = step_memory.check_fits(cfg, mesh)
    input_pipeline.check_train_batch(_data_config(cfg, data_dir))
    return meta, mesh, need


def _restore_or_init(cfg, mesh, ckpt, train_iter, opts) -> tuple[train.TrainState, int]:
    """The newest checkpoint's state (and data position) if resuming, else a fresh state;
    and the run's skipped-step count so far.

    Only reads (and, like `Checkpointer.restore`, moves unreadable steps aside; a start
    from an HF checkpoint records it): every refusal happens here, before any write.
    """
    latest = ckpt.latest_step()
    if latest is not None and not opts.resume:
        raise ResumeRefusedError(
            f"{ckpt.directory} holds checkpoints (latest step {latest}) but resume is off: "
            "use a fresh workdir or resume"
        )
    hf_dir = opts.init_from_hf
    if latest is None and hf_dir:  # logs the start itself
        return hf_init.create_train_state(cfg, mesh, hf_dir, opts.workdir), 0
    if latest is None:
        logging.info("no checkpoint in %s: starting from scratch", ckpt.directory)
        return train.create_train_state(cfg, mesh), 0
    if hf_dir:
        logging.info("checkpoints in %s: resuming them, not reading %s", ckpt.directory, hf_dir)
    restored = ckpt.restore(
        train.abstract_train_state(cfg, mesh),
        config=config_to_dict(cfg),
        ignore_keys=RESUME_IGNORE_KEYS,
    )
    saved_total = ckpt.saved_config(restored.step)["optim"]["total_steps"]
    total = cfg.optim.total_steps
    check_schedule(saved_total, total, restored.step, opts.allow_schedule_change)
    if saved_total != total:
        logging.warning(
            "schedule changed on resume: total_steps %d -> %d from step %d",
            saved_total,
            total,
            restored.step,
        )
    data_state = dict(restored.data_state)
    skipped = int(data_state.pop(SKIPPED_KEY, 0))
    try:
        train_iter.set_state(data_state)
    except ValueError as e:  # another corpus, or the same one prepared again
        raise ResumeRefusedError(
            f"{ckpt.directory}: cannot resume on {opts.data_dir}: {e}; resume on the run's "
            "corpus, or use a fresh workdir"
        ) from e
    logging.info("resumed from checkpoint step %d in %s", restored.step, ckpt.directory)
    return restored.state, skipped


def run(
    cfg: TrainConfig,
    opts: RunOptions,
    clock: progress.Clock = time.perf_counter,
    checked: Checked | None = None,
) -> dict[str, Any]:
    """Trains (or resumes training) to `cfg.optim.total_steps`, or until SIGINT / SIGTERM.

    The signal handlers are installed first, so a Ctrl-C while data loads or the step
    compiles still ends with a checkpoint after the first step.

    Args:
      cfg: the resolved run config.
      opts: run directory, data directory, checkpoint retention, resume switch.
      clock: seconds, like `time.perf_counter` (the progress lines' times and ETA).
      checked: what `check_run(cfg, opts.data_dir)` returned, where the caller ran it
        already (to refuse a bad config its own way); None runs it here.

    Returns:
      Summary dict: `step` reached, `interrupted` (and then `signal`, e.g. "SIGINT"),
      and the last train record's `ce`, `l0_mean`, `sparsity_mean`, `alive_mean` and
      the last `val_ce` when they exist.

    Raises:
      ValueError: before the workdir is touched (`check_run`): the corpus's vocabulary
        does not fit the model, the mesh does not fit the devices, the micro-batch does
        not split over the mesh, or the train split holds less than one batch.
      ConfigMismatchError: (a ValueError, `twell_jax.checkpoint`) the saved config
        differs from `cfg`.
      ResumeRefusedError: (a ValueError) checkpoints exist while `opts.resume` is off.
      ScheduleChangeError: (a ValueError) resuming with another `optim.total_steps`
        without `opts.allow_schedule_change`, or with one below the checkpoint's step.
      WorkdirLockedError: another run holds the workdir.
      StepMemoryError: (a ValueError) one train step cannot fit in device memory.
      DivergenceError: a non-finite loss, gradient norm or state; nothing was saved
        after the last good step.
      FileNotFoundError: `opts.data_dir` is not a prepared corpus.
      EnergyUnavailableError: `opts.energy` where NVML cannot measure (a RuntimeError).
    """
    with StopRequest() as stop:
        logging.info("run %s: Ctrl-C / SIGTERM saves a checkpoint and exits", opts.workdir)
        if checked is None:  # before the lock creates the workdir
            checked = check_run(cfg, opts.data_dir)
        # Process 0 locks the (shared) workdir; the others follow its lead.
        lock = WorkdirLock(opts.workdir) if jax.process_index() == 0 else None
        if lock:
            lock.acquire()
        try:
            trainer = _Trainer(cfg, opts, clock, checked)
            try:
                return trainer.train(stop)
            finally:
                trainer.close()
        finally:
            if lock:
                lock.release()


class _Trainer:
    """One run's state and outputs; `train` is the loop, the other methods its steps."""

    def __init__(self, cfg: TrainConfig, opts: RunOptions, clock: progress.Clock, checked: Checked):
        self.cfg, self.opts, self.clock = cfg, opts, clock
        self.workdir = Path(opts.workdir)
        self.lead = jax.process_index() == 0
        meta, mesh, need = checked
        logging.info("data %s: %s", opts.data_dir, corpus.summary(meta))
        logging.info(
            "mesh %s over %d %s device(s), %d process(es); a train step needs at least "
            "%.2f GiB per device",
            dict(mesh.shape),
            mesh.size,
            jax.default_backend(),
            jax.process_count(),
            need.total / step_memory.GIB,
        )
        # The switch's cutoff for this layer shape, measured (or read back) before the
        # resume check and config.json, so both see the cutoff the run uses (§7.1).
        micro_tokens = cfg.batch_size // cfg.optim.grad_accum_steps * cfg.model.seq_len
        cfg = switch_cost.resolve_cutoff(
            cfg, opts.workdir if self.lead else None, micro_tokens // mesh.size
        )
        self.cfg = cfg
        self.placement = sharding.batch_sharding(mesh)
        self.state_finite = jax.jit(
            all_finite,
            out_shardings=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()),
        )
        data_cfg = _data_config(cfg, opts.data_dir)
        self.train_iter = input_pipeline.make_train_iterator(data_cfg)
        self.ckpt = checkpoint.Checkpointer(
            self.workdir / CHECKPOINT_DIR, max_to_keep=opts.max_to_keep
        )
        self.writer = self.meter = None
        try:
            # Before the resume's writes: a run that cannot measure energy stops here.
            self.meter = energy.EnergyMeter() if opts.energy else None
            self.state, self.skipped = _restore_or_init(cfg, mesh, self.ckpt, self.train_iter, opts)
        except BaseException:
            self.ckpt.close()  # `run` never gets a trainer to close
            if self.meter:
                self.meter.close()
            raise
        if self.meter:
            logging.info("energy: %s", self.meter.describe())
        # The resume is accepted: only now write into the workdir.
        if self.lead:
            config_json = json.dumps(config_to_dict(cfg), indent=2) + "\n"
            (self.workdir / CONFIG_FILE).write_text(config_json)
            run_data.write_data_record(self.workdir, opts.data_dir, meta)
            logging.info("resolved config -> %s", self.workdir / CONFIG_FILE)
        self.step = int(self.state.step)
        self.saved_step = self.step if self.ckpt.latest_step() == self.step else None
        self.plotted_step = None
        if self.lead:
            self.writer = metrics.MetricsWriter(self.workdir, resume_step=self.step)
        self.train_step = train.make_train_step(cfg, mesh, skip_nonfinite=opts.skip_nonfinite > 0)
        self.evaluate = run_data.Evaluator(cfg, data_cfg, mesh, self.placement)
        self.summary: dict[str, Any] = {"step": self.step, "interrupted": False}
        # (step, its metrics) not yet checked for finite loss / grad norm.
        self.unchecked: list[tuple[int, dict[str, jax.Array]]] = []
        # Steps found non-finite and skipped, not yet left out of a progress line.
        self.skipped_unlogged: set[int] = set()

    def train(self, stop: StopRequest) -> dict[str, Any]:
        """Runs the loop to the end, `stop_at` or a stop request; saves; returns the summary."""
        cfg, total = self.cfg, self.cfg.optim.total_steps
        pending: list[tuple[int, dict[str, jax.Array]]] = []
        joules = self.meter.joules if self.meter else None
        timer, compiled = progress.RunTimer(total, clock=self.clock, energy=joules), False
        end = min(total, self.opts.stop_at) if self.opts.stop_at else total
        if self.step >= end:
            logging.info("step %d: nothing to train (stop_at=%d)", self.step, end)
        while self.step < end:
            batch = run_data.global_batch(next(self.train_iter), self.placement, cfg.batch_size)
            self.state, step_metrics = self.train_step(self.state, batch)
            self.step += 1
            pending.append((self.step, step_metrics))
            self.unchecked.append((self.step, {k: step_metrics[k] for k in FINITE_METRICS}))
            if not compiled:
                # The first step compiles; time it apart so that tokens/s is throughput.
                jax.block_until_ready(step_metrics)
                compiled = True
                seconds = timer.compiled(self.step)
                logging.info("step %d: compiled and ran in %.1f s", self.step, seconds)
            else:
                timer.count_step()

            log_now = self.step % cfg.log_every == 0 or self.step == end
            # Multi-host: agree on stopping at log steps only (it is a collective).
            requested = (jax.process_count() == 1 or log_now) and stop.agreed()
            if log_now or requested:  # a stop between log steps logs its steps too
                # Dispatch is asynchronous: wait for the device before reading the clock.
                jax.block_until_ready(step_metrics)
                interval = timer.interval()
                self._check_finite()
                self._log(pending, interval, timer.text(self.step))
                pending = []
            if self.evaluate.enabled and (self.step % cfg.eval_every == 0 or self.step == total):
                jax.block_until_ready(self.state.step)  # pending train steps are train time
                with timer.excluded():  # not training time
                    self._eval()
            if self.step % cfg.checkpoint_every == 0:
                self._save()
            if self.step == end < total:
                logging.info("stop_at=%d reached", self.opts.stop_at)
            if requested:
                logging.warning("stopped at step %d on request", self.step)
                self.summary["interrupted"] = True
                self.summary["signal"] = stop.signal or "SIGINT"
                break
        self._save()
        self.ckpt.wait()
        logging.info("done at step %d/%d; checkpoints %s", self.step, total, self.ckpt.all_steps())
        self.summary["step"] = self.step
        return self.summary

    def _log(
        self,
        pending: list[tuple[int, dict[str, jax.Array]]],
        interval: progress.Interval,
        timing: str,
    ) -> None:
        """Reduces the interval's metrics, prints them with `timing` and records them.

        Skipped steps are left out of the means (unless the whole interval was skipped).
        """
        kept = [m for step, m in pending if step not in self.skipped_unlogged]
        self.skipped_unlogged.clear()
        host = [train.host_metrics(m) for m in kept or [m for _, m in pending]]
        tokens = interval.steps * self.cfg.tokens_per_step
        tokens_per_s = tokens / interval.seconds if interval.steps else None
        record = metrics.reduce_interval(host, self.step, tokens_per_s)
        # Each process meters its own GPUs, which train its share of the tokens.
        tokens_here = tokens // jax.process_count()
        record.update(metrics.energy_fields(interval.joules, interval.seconds, tokens_here))
        record[SKIPPED_KEY] = self.skipped
        line = metrics.format_train_line(record, self.cfg.optim.total_steps, self.cfg.model.d_ff)
        logging.info("%s  %s", line, timing)
        if self.writer:
            self.writer.write(record)
        self.summary.update(
            {k: record[k] for k in ("ce", "l0_mean", "sparsity_mean", "alive_mean", SKIPPED_KEY)}
        )

    def _check_finite(self, state: bool = False) -> None:
        """Checks the unchecked steps' loss and gradient norm.

        A non-finite one is skipped (it left the state unchanged on the device), counted
        and logged while `opts.skip_nonfinite` allows; otherwise it raises.

        Args:
          state: also check every floating-point leaf of the train state (before saves).

        Raises:
          DivergenceError: for the first non-finite step past the skip allowance, or a
            non-finite state.
        """
        unchecked, self.unchecked = self.unchecked, []
        limit = self.opts.skip_nonfinite
        for step, values in jax.device_get(unchecked):
            bad = [(name, float(values[name])) for name in FINITE_METRICS]
            bad = [(name, value) for name, value in bad if not np.isfinite(value)]
            if not bad:
                continue
            if self.skipped >= limit:
                self._diverged(step, *bad[0])
            self.skipped += 1
            self.skipped_unlogged.add(step)
            logging.warning(
                "step %d: non-finite %s: skipped, state unchanged (%d of --skip_nonfinite=%d)",
                step,
                ", ".join(f"{name} {value}" for name, value in bad),
                self.skipped,
                limit,
            )
        if state and not bool(self.state_finite(self.state)):
            self._diverged(self.step, "state", float("nan"))

    def _diverged(self, step: int, metric: str, value: float) -> None:
        self.ckpt.wait()  # earlier saves complete: the last good checkpoints
        raise DivergenceError(step, metric, value, self.ckpt.latest_step(), self.skipped)

    def _eval(self) -> None:
        self._check_finite()
        t0 = self.clock()
        val_ce = self.evaluate(self.state.params)
        logging.info(
            "step %6d  val ce %.4f  (%d batches, %.1f s)",
            self.step,
            val_ce,
            self.cfg.eval_batches,
            self.clock() - t0,
        )
        if self.writer:
            self.writer.write({"step": self.step, "kind": "eval", "val_ce": val_ce})
        self.summary["val_ce"] = val_ce
        self._plot()

    def _save(self) -> None:
        """Starts an async checkpoint of the current step unless it is already saved."""
        if self.saved_step != self.step:
            self._check_finite(state=True)
            data_state = {**self.train_iter.get_state(), SKIPPED_KEY: self.skipped}
            self.ckpt.save(self.step, self.state, data_state, config_to_dict(self.cfg))
            self.saved_step = self.step
            logging.info("checkpoint step %d (async) -> %s", self.step, self.ckpt.directory)

    def _plot(self) -> None:
        if self.writer and self.plotted_step != self.step:
            records = metrics.read_metrics(self.writer.path)
            if any(r["kind"] == "train" for r in records):
                path = self.workdir / metrics.PLOT_FILE
                metrics.plot_metrics(records, path, self.opts.plot_title)
            self.plotted_step = self.step

    def close(self) -> None:
        """Waits for pending saves; final plot (also after an error: the history so far)."""
        self.ckpt.close()
        if self.meter:
            self.meter.close()
        if self.writer:
            self._plot()
            self.writer.close()
