"""Reading preprocessed shards: checksums verified, a seeded shuffled order that resumes exactly, prefetch.

The order is a function of (seed, epoch) alone: batch k of the run is rows perm(epoch)[j*B:(j+1)*B] with
epoch, j = divmod(k, batches_per_epoch). A loader's state is therefore just k, and a restored loader yields
exactly the batches the uninterrupted one would have. In a multi-host run every process computes the same
order and reads only its own slice of each global batch.
"""

from __future__ import annotations

import hashlib
import io
import queue
import re
import tempfile
import threading
from pathlib import Path
from typing import Any

import fsspec
import jax
import numpy as np

from bertforge.data.preprocess import MANIFEST, TOKENIZER_DIR, read_manifest, tokenizer_fingerprint
from bertforge.errors import UserError
from bertforge.tokenizer.load import Tokenizer

_SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*\.npy")


class Shards:
    """One split ('train' or 'valid') of a shard folder, read lazily and checked against its manifest."""

    def __init__(self, root: str, split: str = "train"):
        manifest = read_manifest(root)
        if manifest is None:
            raise UserError(f"{root}: no {MANIFEST} (not preprocessed, or preprocessing did not finish)")
        if split not in manifest.get("splits", {}):
            raise UserError(f"{root}/{MANIFEST}: no '{split}' split")
        self.root, self.split, self.manifest = root.rstrip("/"), split, manifest
        self.fs, _, (self._path,) = fsspec.get_fs_token_paths(self.root)
        self.seq_len = int(manifest["seq_len"])
        self.entries = list(manifest["splits"][split]["shards"])
        for entry in self.entries:
            # Names come from a file: never let one point outside the folder.
            if not _SAFE_NAME.fullmatch(str(entry.get("path", ""))):
                raise UserError(f"{root}/{MANIFEST}: shard name {entry.get('path')!r} is not a plain file name")
        counts = np.array([int(e["sequences"]) for e in self.entries], np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(counts)])
        self._arrays: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()

    @property
    def num_sequences(self) -> int:
        return int(self.offsets[-1])

    @property
    def packed(self) -> bool:
        """Whether rows hold several sequences, each starting with [CLS] (preprocess --pack)."""
        return bool(self.manifest.get("packed", False))

    @property
    def pad_id(self) -> int:
        return int(self.manifest["special_ids"]["pad"])

    def tokenizer(self) -> tuple[Tokenizer, str]:
        """The tokenizer the shards were made with, and where it was read from.

        A shard folder carries its own copy, read through fsspec wherever the folder now is (another directory,
        a bucket); folders made before that name the tokenizer folder given to `preprocess`.
        """
        name = self.manifest.get("tokenizer")
        if name is None:
            source = str(self.manifest.get("settings", {}).get("tokenizer", ""))
            return Tokenizer.load(source), source
        if name != TOKENIZER_DIR:  # a name from a file: never a path outside the folder
            raise UserError(f"{self.root}/{MANIFEST}: tokenizer {name!r} is not the folder's own '{TOKENIZER_DIR}'")
        source = f"{self.root}/{name}"
        with tempfile.TemporaryDirectory() as tmp:
            for file in ("tokenizer.json", "tokenizer_config.json"):
                try:
                    Path(tmp, file).write_bytes(self.fs.cat_file(f"{self._path}/{name}/{file}"))
                except FileNotFoundError:
                    raise UserError(f"{source}/{file}: missing (the shard folder was copied in part)") from None
            return Tokenizer.load(tmp), source

    def check_tokenizer(self, tokenizer: Any, source: str) -> None:
        """The shards must have been made with this very tokenizer."""
        if tokenizer_fingerprint(tokenizer) != self.manifest["tokenizer_sha256"]:
            raise UserError(
                f"{self.root}/{MANIFEST} was made with another tokenizer than {source} "
                f"(sha256 {self.manifest['tokenizer_sha256'][:12]}... vs {tokenizer_fingerprint(tokenizer)[:12]}...)"
            )

    def check_model(self, max_seq_len: int, vocab_size: int, source: str) -> None:
        """The model's position table must hold the sequences, and its embedding table every token id."""
        if self.seq_len > max_seq_len:
            raise UserError(
                f"{self.root}: sequences of {self.seq_len} tokens do not fit the position table of {source} "
                f"({max_seq_len} positions); preprocess with --seq-len {max_seq_len} or less"
            )
        if int(self.manifest["vocab_size"]) > vocab_size:
            raise UserError(
                f"{self.root}: token ids go up to {self.manifest['vocab_size'] - 1} but {source} has "
                f"{vocab_size} embeddings"
            )

    def _load(self, i: int) -> np.ndarray:
        entry = self.entries[i]
        path = f"{self._path}/{entry['path']}"
        try:
            with self.fs.open(path, "rb") as fh:
                data = fh.read()
        except FileNotFoundError:
            raise UserError(f"{self.root}/{entry['path']}: shard missing") from None
        if hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise UserError(f"{self.root}/{entry['path']}: sha256 does not match {MANIFEST} (damaged or altered)")
        try:
            array = np.load(io.BytesIO(data), allow_pickle=False)
        except ValueError:  # an object array: loading it would unpickle
            raise UserError(f"{self.root}/{entry['path']}: not a plain array of token ids (never unpickled)") from None
        if array.shape != (int(entry["sequences"]), self.seq_len):
            raise UserError(f"{self.root}/{entry['path']}: shape {array.shape} disagrees with {MANIFEST}")
        return array

    def shard(self, i: int) -> np.ndarray:
        with self._lock:
            if i not in self._arrays:
                self._arrays[i] = self._load(i)
            return self._arrays[i]

    def verify(self) -> None:
        """Read and check every shard now (otherwise each is checked when first read)."""
        for i in range(len(self.entries)):
            self.shard(i)

    def rows(self, indices: np.ndarray) -> np.ndarray:
        """(n,) global row indices -> (n, T) int32 token ids."""
        return rows_of_parts(indices, self.offsets, self.seq_len, lambda s, rows: self.shard(s)[rows])


def rows_of_parts(indices: np.ndarray, offsets: np.ndarray, seq_len: int, read: Any) -> np.ndarray:
    """(n,) row numbers over parts laid one after another (part s: rows offsets[s]..offsets[s+1]-1) -> (n, T) int32
    token ids, `read(s, rows)` giving part s's rows."""
    indices = np.asarray(indices, np.int64)
    which = np.searchsorted(offsets, indices, side="right") - 1
    out = np.empty((len(indices), seq_len), np.int32)
    for s in np.unique(which):
        sel = which == s
        out[sel] = read(int(s), indices[sel] - offsets[s])
    return out


class BatchLoader:
    """Global batches of token ids in a seeded shuffled order, epoch after epoch, with background prefetch.

    Each process gets its slice of every global batch: a numpy (B / processes, T) array, or a global jax.Array
    laid out by `sharding` (e.g. batch over the mesh's data axes) when one is given.
    """

    def __init__(
        self,
        shards: Shards,
        global_batch: int,
        seed: int = 0,
        sharding: jax.sharding.Sharding | None = None,
        process_index: int | None = None,
        process_count: int | None = None,
        prefetch: int = 2,
    ):
        self.shards, self.global_batch, self.seed, self.sharding = shards, global_batch, seed, sharding
        self.process_index = jax.process_index() if process_index is None else process_index
        self.process_count = jax.process_count() if process_count is None else process_count
        if global_batch % self.process_count:
            raise UserError(f"global batch {global_batch} does not split over {self.process_count} processes")
        self.local_batch = global_batch // self.process_count
        self.batches_per_epoch = shards.num_sequences // global_batch
        if self.batches_per_epoch == 0:
            raise UserError(
                f"{shards.root}: the {shards.split} split has {shards.num_sequences} sequences, "
                f"fewer than one global batch of {global_batch}"
            )
        self.prefetch = prefetch
        self.step = 0
        self._perm_cache: tuple[int, np.ndarray] | None = None
        self._queue: queue.Queue | None = None
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------------------------------------- order
    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perm_cache is None or self._perm_cache[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            dtype = np.int32 if self.shards.num_sequences < 2**31 else np.int64
            self._perm_cache = (epoch, rng.permutation(self.shards.num_sequences).astype(dtype))
        return self._perm_cache[1]

    def epoch_of(self, k: int) -> int:
        return k // self.batches_per_epoch

    def global_indices(self, k: int) -> np.ndarray:
        """Row indices of global batch k (B,)."""
        epoch, j = divmod(k, self.batches_per_epoch)
        return self._permutation(epoch)[j * self.global_batch : (j + 1) * self.global_batch]

    def local_rows(self, k: int) -> np.ndarray:
        """This process's part of global batch k: (B / processes, T) int32."""
        start = self.process_index * self.local_batch
        return self.shards.rows(self.global_indices(k)[start : start + self.local_batch])

    def _make(self, k: int) -> Any:
        local = self.local_rows(k)
        if self.sharding is None:
            return local
        shape = (self.global_batch, self.shards.seq_len)
        return jax.make_array_from_process_local_data(self.sharding, local, shape)

    # ------------------------------------------------------------------------------------------------- iteration
    def _producer(self, start: int, q: queue.Queue, stop: threading.Event) -> None:
        k = start
        while not stop.is_set():
            try:
                item: Any = (k, self._make(k))
            except BaseException as e:  # hand the error to the consumer
                item = (k, e)
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if isinstance(item[1], BaseException):
                return
            k += 1

    def _start(self) -> None:
        self.close()
        if self.prefetch <= 0:
            return
        self._queue, self._stop = queue.Queue(maxsize=self.prefetch), threading.Event()
        self._thread = threading.Thread(target=self._producer, args=(self.step, self._queue, self._stop), daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self._stop is not None:
            self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._queue = self._stop = self._thread = None

    def __iter__(self) -> BatchLoader:
        return self

    def __next__(self) -> Any:
        if self.prefetch <= 0:
            batch = self._make(self.step)
        else:
            if self._thread is None:
                self._start()
            assert self._queue is not None
            k, batch = self._queue.get()
            assert k == self.step, (k, self.step)
            if isinstance(batch, BaseException):
                self.close()
                raise batch
        self.step += 1
        return batch

    def next_at(self, progress: float) -> Any:
        """The next batch; its size does not depend on the run's progress (see ramp.RampedLoader)."""
        return next(self)

    @property
    def rows_served(self) -> int:
        return self.step * self.global_batch

    @property
    def epoch(self) -> int:
        """The epoch of the next batch."""
        return self.epoch_of(self.step)

    # ------------------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, int]:
        return {
            "step": self.step,
            "seed": self.seed,
            "global_batch": self.global_batch,
            "num_sequences": self.shards.num_sequences,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "micro_batches" in state:
            raise UserError("the checkpoint was taken with train.batch_ramp; resume it with the same ramp")
        if "mixture" in state:
            raise UserError(f"the checkpoint was taken reading the mixture {state['mixture']}; resume it with it")
        for key in ("seed", "global_batch", "num_sequences"):
            if int(state[key]) != self.state_dict()[key]:
                raise UserError(
                    f"the saved data position was taken with {key}={state[key]}, this run has "
                    f"{self.state_dict()[key]}: the data order would differ"
                )
        self.close()
        self.step = int(state["step"])
