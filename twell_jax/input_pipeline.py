"""The grain pipelines that read a prepared corpus: windows, batches, resumable state.

Reading cuts each shard's stream into windows of `seq_len + 1` tokens with stride `seq_len`
(each token is a target once per epoch; windows never span shards), then a grain `MapDataset`
takes every `process_count`-th window for this process, shuffles (seeded, reshuffled each
epoch), repeats forever and batches. The iterator's state is a small JSON dict, saved with
each checkpoint.
"""

import dataclasses
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grain
import jax
import numpy as np
from absl import logging

from twell_jax import corpus


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where the token shards are and how batches are cut from them.

    Attributes:
      data_dir: directory holding meta.json and the shards.
      seq_len: tokens per example S; windows hold S + 1 tokens.
      batch_size: global batch size B over all processes; each process yields
        B // process_count rows.
      seed: shuffle seed.
      shuffle: shuffle training windows (validation is never shuffled).
      num_threads: grain prefetch threads per process.
    """

    data_dir: str = corpus.DEFAULT_DATA_DIR
    seq_len: int = 256
    batch_size: int = 16
    seed: int = 0
    shuffle: bool = True
    num_threads: int = 2

    def __post_init__(self):
        if self.seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {self.seq_len}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.num_threads < 0:
            raise ValueError(f"num_threads must be >= 0, got {self.num_threads}")


class TokenWindows:
    """Random-access source of token windows over a split's shards.

    Window i is `shard[i' * S : i' * S + S + 1]` of the shard it falls in: [S + 1] int32.
    `names` (the shard paths) only label errors.
    """

    def __init__(
        self,
        shards: Sequence[np.ndarray],
        seq_len: int,
        vocab_size: int,
        names: Sequence[str] = (),
    ):
        self._shards, self._seq_len, self._vocab_size = shards, seq_len, vocab_size
        self._names = names
        counts = [max(0, (len(s) - 1) // seq_len) for s in shards]
        self._ends = np.cumsum(counts)

    def __len__(self) -> int:
        return int(self._ends[-1]) if len(self._ends) else 0

    def __getitem__(self, index: int) -> np.ndarray:
        shard = int(np.searchsorted(self._ends, index, side="right"))
        local = index - (int(self._ends[shard - 1]) if shard else 0)
        start = local * self._seq_len
        window = np.asarray(self._shards[shard][start : start + self._seq_len + 1], np.int32)
        # A cheap per-window check: garbled shard bytes surface here, not as NaNs in training.
        if window.max() >= self._vocab_size:
            name = self._names[shard] if self._names else f"#{shard}"
            raise ValueError(
                f"corrupt shard {name}: token {window.max()} >= "
                f"vocab_size {self._vocab_size} near offset {start}"
            )
        return window


def _windows(
    cfg: DataConfig, split: str, process_index: int | None, process_count: int | None
) -> tuple[grain.MapDataset, int, int, dict[str, Any]]:
    """This process's windows of `split`, per-process batch size, min batches/process, meta."""
    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} not in [0, {process_count})")
    if cfg.batch_size % process_count:
        raise ValueError(
            f"batch_size {cfg.batch_size} is not divisible by process_count {process_count}"
        )
    meta = corpus.load_meta(cfg.data_dir)
    names = [str(Path(cfg.data_dir) / s["file"]) for s in meta["splits"][split]["shards"]]
    source = TokenWindows(
        corpus.open_shards(cfg.data_dir, split, meta),
        cfg.seq_len,
        meta["tokenizer"]["vocab_size"],
        names,
    )
    per_process = cfg.batch_size // process_count
    # Every process needs at least one full batch, or it would stall collectives.
    if len(source) // process_count < per_process:
        raise ValueError(
            f"{split} split of {cfg.data_dir} has {len(source)} windows of {cfg.seq_len + 1} "
            f"tokens, fewer than one batch of {per_process} per process x {process_count} "
            "(prepare more text, or lower seq_len or batch_size)"
        )
    ds = grain.MapDataset.source(source)[process_index::process_count]
    return ds, per_process, len(source) // process_count // per_process, meta


def _split_inputs_targets(windows: np.ndarray) -> dict[str, np.ndarray]:
    """[B, S + 1] -> {"inputs": [B, S], "targets": [B, S]} int32, targets shifted by one."""
    return {"inputs": windows[:, :-1], "targets": windows[:, 1:]}


class DataIterator:
    """Endless training batches with JSON-serialisable, validated `get_state`/`set_state`.

    Yields:
      {"inputs": int32 [B_p, S], "targets": int32 [B_p, S]}, B_p = batch_size // processes.
    """

    def __init__(self, it: grain.DatasetIterator, fingerprint: dict[str, Any]):
        self._it, self._fingerprint = it, fingerprint

    def __iter__(self) -> "DataIterator":
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        return next(self._it)

    def get_state(self) -> dict[str, Any]:
        """Returns the position: a JSON-serialisable dict, equal on every process."""
        return {"grain": self._it.get_state(), "fingerprint": self._fingerprint}

    def set_state(self, state: dict[str, Any]):
        """Resumes from `get_state()`'s result.

        Raises:
          ValueError: the state was taken from a pipeline with different data or shapes.
        """
        saved = state.get("fingerprint", {})
        diff = sorted(
            k
            for k in saved.keys() | self._fingerprint.keys()
            if k != "process_count" and saved.get(k) != self._fingerprint.get(k)
        )
        if diff:
            raise ValueError(
                "data iterator state does not match this pipeline: "
                + ", ".join(
                    f"{k}: saved {saved.get(k)!r} != {self._fingerprint.get(k)!r}" for k in diff
                )
            )
        if saved.get("process_count") != self._fingerprint["process_count"]:
            logging.warning(
                "resuming data from %s processes on %s: the batch order changes",
                saved.get("process_count"),
                self._fingerprint["process_count"],
            )
        self._it.set_state(state["grain"])


def check_train_batch(cfg: DataConfig, process_count: int | None = None) -> None:
    """Raises what `make_train_iterator` would for a corpus it cannot read or whose train
    split holds less than one batch per process, without building the pipeline.

    Args:
      cfg: the data config.
      process_count: defaults to `jax.process_count()` (which starts JAX's backend).

    Raises:
      FileNotFoundError / ValueError: as `make_train_iterator`.
    """
    count = jax.process_count() if process_count is None else process_count
    _windows(cfg, "train", 0, count)  # the same check on every process


def make_train_iterator(
    cfg: DataConfig, process_index: int | None = None, process_count: int | None = None
) -> DataIterator:
    """Returns this process's endless, shuffled, checkpointable training iterator.

    Args:
      cfg: the data config; `cfg.data_dir` must be prepared (see `corpus.ensure_default_data`).
      process_index: this process's index; defaults to `jax.process_index()`.
      process_count: number of processes; defaults to `jax.process_count()`.

    Raises:
      FileNotFoundError / ValueError: missing or corrupt meta.json or shards, or too little
        data for one batch.
    """
    ds, per_process, _, meta = _windows(cfg, "train", process_index, process_count)
    if cfg.shuffle:
        ds = ds.shuffle(seed=cfg.seed)
    ds = ds.repeat(None).batch(per_process, drop_remainder=True).map(_split_inputs_targets)
    read = grain.ReadOptions(num_threads=cfg.num_threads, prefetch_buffer_size=4)
    fingerprint = {
        "seq_len": cfg.seq_len,
        "batch_size": cfg.batch_size,
        "seed": cfg.seed,
        "shuffle": cfg.shuffle,
        "train_tokens": meta["splits"]["train"]["num_tokens"],
        "tokenizer": meta["tokenizer"]["fingerprint"],
        "process_count": jax.process_count() if process_count is None else process_count,
    }
    return DataIterator(iter(ds.to_iter_dataset(read)), fingerprint)


def make_val_iterator(cfg: DataConfig, num_batches: int) -> Iterator[dict[str, np.ndarray]]:
    """Returns a fresh iterator over this process's rows (`jax.process_index()` of
    `jax.process_count()`) of the first validation batches, in order (no shuffle).

    Every call yields the same batches, so evaluations are comparable across steps. All
    processes yield the same number of batches.

    Args:
      cfg: the data config (`seq_len`, `batch_size`, `data_dir` are used).
      num_batches: at most this many batches; fewer if the val split is smaller.

    Yields:
      {"inputs": int32 [B_p, S], "targets": int32 [B_p, S]}.
    """
    if num_batches < 1:
        raise ValueError(f"num_batches must be >= 1, got {num_batches}")
    ds, per_process, full_batches, _ = _windows(cfg, "val", None, None)
    n = min(num_batches, full_batches)
    ds = ds[: n * per_process].batch(per_process, drop_remainder=True).map(_split_inputs_targets)
    return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=cfg.num_threads)))
