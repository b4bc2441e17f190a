"""Where a pre-training run reads and writes, and how it resumes and stops: the
options `twell_jax.trainer.run` takes beside the config (not checkpointed)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """Where a run reads and writes; not part of the checkpointed config.

    Attributes:
      workdir: run directory: checkpoints/, metrics.jsonl, metrics.png, config.json.
      data_dir: a corpus prepared by `twell_jax.corpus` (meta.json + shards).
      max_to_keep: newest checkpoints kept; None keeps all.
      resume: continue from the newest checkpoint in `workdir` if there is one.
      stop_at: if > 0, save and return after this step even though the schedule runs to
        `total_steps` (time-sliced jobs).
      plot_title: title of metrics.png.
      allow_schedule_change: on resume, accept an `optim.total_steps` unlike the
        checkpoint's. The LR schedule is a function of the step and total_steps, so the
        run continues on the new schedule from the checkpoint's step: the warmup is
        unchanged and the cosine is stretched (or shortened) to end at the new total,
        which moves the LR at the resumed step to the new curve's value there.
      skip_nonfinite: K > 0 skips (on the device) each step whose loss or gradient norm
        is not finite, logs and counts it (`skipped_steps` in metrics.jsonl and the
        checkpoints) and raises `DivergenceError` at the (K+1)-th. A skipped step uses
        up its batch and the step counter but not the optimizer's count (the LR
        schedule falls behind by one). 0: stop at the first.
      init_from_hf: an HF Llama directory whose weights start a run without checkpoints
        (`twell_jax.hf.init`; cfg has its architecture); a resume does not read it.
      energy: measure the GPUs' energy (`twell_jax.energy.EnergyMeter` over the visible
        GPUs) and log joules per token of each interval (`metrics.energy_fields`; per
        token of this process's share of the batch).
    """

    workdir: str
    data_dir: str
    max_to_keep: int | None = 3
    resume: bool = True
    stop_at: int = 0
    plot_title: str = ""
    allow_schedule_change: bool = False
    skip_nonfinite: int = 0
    init_from_hf: str | None = None
    energy: bool = False
