"""The `--energy` flag, shared: `experiments.benchmark` and `experiments.pretrain` both
read it, and a process may import both (absl refuses a flag defined twice)."""

from absl import flags

ENERGY = flags.DEFINE_bool(
    "energy",
    False,
    "Measure GPU energy through NVML (twell_jax.energy; pip install '.[energy]'): joules "
    "per token of each timed step (experiments.benchmark --mode=train_model) or of each "
    "logging interval (experiments.pretrain). Without a measurable NVIDIA GPU the "
    "program stops before it measures anything (exit 1).",
)
