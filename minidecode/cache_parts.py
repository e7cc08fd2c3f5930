"""Each rank's part of a saved cache file, as the step plan asks for it (plan.py's FileSave,
FileOpen and FileRead): written from a region of the engine's cache, opened and checked against
this rank's weights and place among the ranks (tp, cp, rank, the dealing's chunk), read into a
region. Under torchrun every rank runs the same plan, so each writes, checks and reads its own
part (cache_file.part_path names it); in one process the part is the file."""

from __future__ import annotations

from pathlib import Path

import torch

from minidecode.models.cache import KVCache
from minidecode.models.llama import Transformer
from minidecode.models.sharding import CP_CHUNK

from .cache_file import (
    CacheFile,
    launch_name,
    open_cache_file,
    part_path,
    place_metadata,
    read_cache_file,
    weights_fingerprint,
    write_cache_file,
)
from .errors import UserError
from .plan import FileOpen, FileRead, FileSave


class CacheParts:
    """This rank's cache-file parts: its place, the part a FileOpen opened (by the path given)
    until the FileRead that reads it, and its weights' fingerprint (computed once)."""

    def __init__(self, model: Transformer, kv_dtype: torch.dtype):
        self.model, self.kv_dtype = model, kv_dtype
        self.place = (1, 1, 0, CP_CHUNK)  # (tp, cp, rank, the positions of a dealt chunk under cp)
        self.opened: dict[Path, CacheFile] = {}
        self._fingerprint: str | None = None

    def fingerprint(self) -> str:
        """This rank's weights' fingerprint (its shard's under --tp)."""
        if self._fingerprint is None:
            self._fingerprint = weights_fingerprint(self.model)
        return self._fingerprint

    def layout(self, length: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """{name: (dtype, shape)} of this rank's saved cache tensors of a `length`-position prefix
        (its share of the positions under context parallelism)."""
        cfg, positions = self.model.config, self.model.held_positions(length)
        shape = (cfg.num_layers, 1, cfg.num_kv_heads, positions, cfg.head_dim)
        template = KVCache(*shape, self.kv_dtype, "meta")
        return {name: (t.dtype, tuple(t.shape)) for name, t in template.tensors().items()}

    def save(self, op: FileSave, tensors: dict[str, torch.Tensor]) -> int:
        """Write `tensors` (the region's valid positions) as this rank's part -> its bytes."""
        tp, cp, rank, _ = self.place
        meta = dict(op.metadata, weights_fingerprint=self.fingerprint())
        meta.update(place_metadata(*self.place))
        return write_cache_file(part_path(op.path, rank, tp * cp), tensors, op.ids, meta)

    def open(self, op: FileOpen) -> tuple[str | None, int]:
        """Open and check this rank's part, kept for the FileRead -> (its save's id, its length)."""
        tp, cp, rank, _ = self.place
        path = part_path(op.path, rank, tp * cp)
        self.opened = {}
        if rank and not path.exists():
            raise UserError(
                f"cache file {op.path} has no part for rank {rank}: {path.name} is missing (a cache "
                f"saved under {launch_name(tp, cp)} is a part per rank, side by side); save it again "
                f"under {launch_name(tp, cp)}"
            )
        identity = dict(op.identity, weights_fingerprint=self.fingerprint())
        file = open_cache_file(path, identity, self.layout, place_metadata(*self.place))
        self.opened = {op.path: file}
        return file.metadata.get("save_id"), file.length

    def read(self, op: FileRead, tensors: dict[str, torch.Tensor]) -> None:
        """This rank's opened part of op.file into `tensors` (the region it fills); in one process
        the file rank 0 opened is the part."""
        file = self.opened.pop(op.file.path, op.file if self.place[:3] == (1, 1, 0) else None)
        if file is None:
            raise UserError(f"cache file {op.file.path} was not opened on rank {self.place[2]}")
        read_cache_file(file, tensors)
