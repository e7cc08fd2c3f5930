"""A prefilled KV cache on disk: the safetensors layout, written and read one piece at a time.

The file holds only the valid positions: each stored cache tensor (positions on dim 3, e.g. K
and V `[layers, B, Hkv, S, D]`) becomes `[layers, B, Hkv, length, ...]`, plus `token_ids`
[length] int64; an FP8 cache's V holds blocks of V_BLOCK positions on dim 3 (minidecode/cache.py),
so the file holds its ceil(length / V_BLOCK) blocks, `[layers, B, Hkv, blocks, D, V_BLOCK]`.
Its `__metadata__` records the format version, the model's identity (a hash of config.json and a
weights fingerprint), the cache dtype and the length; loading refuses a file that does not
match. One (layer, sequence, KV head) run of positions is contiguous both in the cache and in
the file, so the file is streamed run by run through one small host buffer: never a
second full copy in host memory. Writes go to a temporary file in the same folder, fsynced and
renamed over the target: a crash mid-write leaves no half-written file under the target name.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .errors import UserError

FORMAT = "minidecode.kv-cache"
# 2: an FP8 cache's V is stored blocked. 3: an FP8 cache's scales are bfloat16, K's and V's side
# by side in one tensor (kv_scale; format 2 had float32 k_scale and v_scale). An FP8 file of an
# earlier format is refused, not converted: it is a cache, which a prefill makes again. Files of
# other cache dtypes hold the same layout in every format and load as they are.
FORMAT_VERSION = 3
FP8_LAYOUT_SINCE = 3
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit
ST_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
IDENTITY_ERRORS = {  # identity key -> why the file does not fit this model
    "config_sha256": "was made by another model (its config.json differs)",
    "cache_dtype": "holds a {found} cache, but this model's cache is {expected}",
    "weights_fingerprint": "was made with other weights (same config; other weights, or another dtype)",
}

# (dtype, shape) of each stored cache tensor for a given length; from the engine
Layout = Callable[[int], dict[str, tuple[torch.dtype, tuple[int, ...]]]]


def config_hash(text: bytes) -> str:
    return hashlib.sha256(text).hexdigest()


@torch.no_grad()
def weights_fingerprint(model: nn.Module, samples: int = 16) -> str:
    """A cheap hash of the weights: each parameter's name, shape, dtype and `samples` values at
    evenly spaced flat indices (one small gather per tensor, one transfer in all)."""
    digest, picked = hashlib.sha256(), []
    for name, p in model.named_parameters():
        digest.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
        flat = p.detach().reshape(-1)
        count = min(samples, flat.numel())  # integer steps: float32 linspace overshoots past 2^24
        index = torch.arange(count, device=flat.device) * (flat.numel() - 1) // max(count - 1, 1)
        picked.append(flat[index].double())
    digest.update(torch.cat(picked).cpu().numpy().tobytes())
    return digest.hexdigest()[:32]


def _pieces(tensor: torch.Tensor):
    """The contiguous runs of positions: tensor[l, b, h] for every (l, b, h), in the file's
    (row-major) order."""
    for index in itertools.product(*(range(n) for n in tensor.shape[:3])):
        yield tensor[index]


def _host_buffer(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """One pinned staging buffer for the largest run (CUDA); None on the CPU (no staging)."""
    if tensors[0].device.type != "cuda":
        return None
    nbytes = max(t[0, 0, 0].numel() * t.element_size() for t in tensors)
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _as_bytes(t: torch.Tensor):
    """A writable byte view (numpy array) of a contiguous CPU tensor, no copy."""
    return t.view(torch.uint8).numpy() if t.dim() else t.reshape(1).view(torch.uint8).numpy()


def _write_tensor(f, tensor: torch.Tensor, staging: torch.Tensor | None) -> None:
    for piece in _pieces(tensor):
        if staging is None:
            f.write(_as_bytes(piece.contiguous()))
            continue
        host = staging[: piece.numel() * piece.element_size()].view(piece.dtype).view(piece.shape)
        host.copy_(piece)  # device -> pinned host, synchronous
        f.write(_as_bytes(host))


def write_cache_file(
    path: Path, tensors: dict[str, torch.Tensor], token_ids: list[int], metadata: dict[str, str]
) -> int:
    """Write `tensors` (a cache's stored tensors cut on dim 3 to positions 0..len(token_ids)-1:
    KVCache.region(0, length).tensors()) and the token ids to `path`, atomically; returns the
    file's size in bytes."""
    length = len(token_ids)
    ids = torch.tensor(token_ids, dtype=torch.int64)
    header: dict = {"__metadata__": {"format": FORMAT, "format_version": str(FORMAT_VERSION), **metadata}}
    header["__metadata__"]["length"] = str(length)
    offset = 0
    for name, t in [*tensors.items(), ("token_ids", ids)]:
        shape = list(t.shape)
        nbytes = t.element_size() * int(torch.Size(shape).numel())
        header[name] = {
            "dtype": ST_DTYPES[t.dtype],
            "shape": shape,
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned, as safetensors writes it
    staging = _host_buffer(list(tensors.values()))
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for t in tensors.values():
                _write_tensor(f, t, staging)
            f.write(_as_bytes(ids))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        tmp = None
        _fsync_dir(path.parent)
    except OSError as e:
        raise UserError(f"could not write cache file {path}: {e.strerror or e}") from None
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
    return 8 + len(blob) + offset


def _fsync_dir(folder: Path) -> None:
    """Make the rename durable (POSIX); a no-op where folders cannot be opened."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class CacheFile:
    """A checked cache file: its metadata, token ids, and where each tensor's bytes lie."""

    path: Path
    metadata: dict[str, str]
    token_ids: list[int]
    entries: dict[str, tuple[torch.dtype, tuple[int, ...], int]]  # name -> (dtype, shape, file offset)

    @property
    def length(self) -> int:
        return len(self.token_ids)


def open_cache_file(path: Path, identity: dict[str, str], layout: Layout) -> CacheFile:
    """Read and check the header of the cache file at `path`: format, version, model identity,
    tensor names, dtypes and shapes (`layout(length)`), and that the file holds every byte the
    header promises. Any mismatch is one UserError line."""
    if not path.is_file():
        raise UserError(f"cache file {path} does not exist")
    size = path.stat().st_size

    def bad(why: str) -> UserError:
        return UserError(f"cache file {path} {why}")

    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise bad("is truncated or not a minidecode cache file")
        n = struct.unpack("<Q", head)[0]
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise bad("is truncated or not a minidecode cache file (bad header length)")
        try:
            header = json.loads(f.read(n))
            meta = header.pop("__metadata__")
            if meta.get("format") != FORMAT:
                raise bad("is not a minidecode cache file")
            version = int(meta["format_version"])
            if version > FORMAT_VERSION:
                raise bad(
                    f"was written by a newer minidecode (format {version}; this one reads up to "
                    f"{FORMAT_VERSION}): upgrade minidecode or prefill again"
                )
            for key, why in IDENTITY_ERRORS.items():
                if meta.get(key) != identity[key]:
                    raise bad(why.format(found=meta.get(key), expected=identity[key]))
            if version < FP8_LAYOUT_SINCE and identity["cache_dtype"] == "float8_e4m3fn":
                raise bad(
                    f"holds an FP8 cache in format {version}, whose layout this minidecode no longer "
                    "reads: prefill the prompt again and save a new cache file"
                )
            length = int(meta["length"])
            expected = dict(layout(length), token_ids=(torch.int64, (length,)))
            if set(header) != set(expected) or length < 1:
                raise bad(f"is corrupted (tensors {sorted(header)}, expected {sorted(expected)})")
            entries, end = {}, 0
            for name, (dtype, shape) in expected.items():
                entry = header[name]
                begin, stop = entry["data_offsets"]
                if entry["dtype"] != ST_DTYPES[dtype] or tuple(entry["shape"]) != shape:
                    raise bad(f"is corrupted ({name}: {entry['dtype']} {entry['shape']}, expected {shape})")
                if begin != end or stop - begin != torch.Size(shape).numel() * dtype.itemsize:
                    raise bad(f"is corrupted ({name}: bad data offsets)")
                entries[name], end = (dtype, shape, 8 + n + begin), stop
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise bad(f"is corrupted (bad header: {type(e).__name__})") from None
        if 8 + n + end != size:
            raise bad(f"is truncated or corrupted ({size:,} bytes, the header describes {8 + n + end:,})")
        ids = torch.empty(length, dtype=torch.int64)
        f.seek(entries["token_ids"][2])
        _read_exactly(f, _as_bytes(ids), path)
    return CacheFile(path, meta, ids.tolist(), entries)


def _read_exactly(f, buffer, path: Path) -> None:
    view, got = memoryview(buffer).cast("B"), 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise UserError(f"cache file {path} is truncated (it changed while being read)")
        got += n


def read_cache_file(file: CacheFile, tensors: dict[str, torch.Tensor]) -> None:
    """Fill the cache `tensors` (its stored tensors cut on dim 3 to the positions wanted, at most
    the file's: KVCache.region(0, count).tensors()) from the start of each run of `file`, one run
    at a time (through one pinned buffer on CUDA, straight in on the CPU)."""
    staging = _host_buffer(list(tensors.values()))
    with open(file.path, "rb", buffering=0) as f:
        for name, t in tensors.items():
            _, shape, offset = file.entries[name]
            run_bytes = torch.Size(shape[3:]).numel() * t.element_size()  # one file run: length positions
            for i, piece in enumerate(_pieces(t)):
                f.seek(offset + i * run_bytes)
                if staging is None:
                    _read_exactly(f, _as_bytes(piece), file.path)
                    continue
                host = staging[: piece.numel() * piece.element_size()]
                _read_exactly(f, host.numpy(), file.path)
                piece.copy_(host.view(piece.dtype).view(piece.shape))  # pinned host -> device
