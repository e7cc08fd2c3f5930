"""A prefilled KV cache on disk: the safetensors layout, written and read one piece at a time.

The file holds only the valid positions: each stored cache tensor (positions on dim 3, e.g. K
and V `[layers, B, Hkv, S, D]`) becomes `[layers, B, Hkv, length, ...]`, plus `token_ids`
[length] int64; an FP8 cache's V holds blocks of V_BLOCK positions on dim 3 (models/cache.py),
so the file holds its ceil(length / V_BLOCK) blocks, `[layers, B, Hkv, blocks, D, V_BLOCK]`.
Its `__metadata__` records the format version, the model's identity (a hash of config.json and a
fingerprint of every byte of the weights), the cache dtype, the length, and a checksum of every
chunk of positions of every tensor; loading refuses a file that does not match. One (layer,
sequence, KV head) run of positions is contiguous both in the cache and in the file, so the file
is streamed run by run through one small host buffer: never a second full copy in host memory.
The checksums are computed on the cache's device as the runs stream out (the header, written
first with placeholders of the same length, is rewritten at the end) and checked as they stream
back in. Writes go to a temporary file in the same folder, fsynced and renamed over the target: a
crash mid-write leaves no half-written file under the target name.

Under torchrun a cache is one such file per rank, of that rank's KV heads (--tp) and of its share
of the positions (--cp: `length` is the prefix's, the tensors hold the rank's positions of it):
rank 0's at the path given, rank k's beside it (part_path); each records its place (tp, cp, rank,
world size, the dealing's chunk), its shard's weights fingerprint and the save's id, and is checked
by the rank that reads it.
"""

from __future__ import annotations

import functools
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

from minidecode.models.sharding import CP_CHUNK

from .errors import UserError

FORMAT = "minidecode.kv-cache"
# 2: an FP8 cache's V is stored blocked. 3: an FP8 cache's scales are bfloat16, K's and V's side
# by side in one tensor (kv_scale; format 2 had float32 k_scale and v_scale). 4: checksums of the
# data. A file of an earlier format is refused, not converted: it is a cache, which a prefill
# makes again.
FORMAT_VERSION = 4
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


# ---- checksums -----------------------------------------------------------------------------------
# Data is summed where it lies (the GPU for a GPU cache), as int16 words, each word times a weight
# given by its place in its chunk: distinct weights in 1 .. 2^31 - 1, an exact int64 sum (|word| <=
# 2^15 and a chunk holds at most 2^16 words, so |sum| < 2^62: no overflow, the same value on every
# device). Changing one word always changes its chunk's sum; a changed range (overwritten, zeroed,
# shifted, swapped) keeps it only by an exact cancellation of the weighted differences (odds of
# about 2^-31 or less). A cache tensor's chunk c is entries c*n .. c*n+n-1 on dim 3 of every run
# (n: CHUNK_WORDS words a run); the file keeps, per chunk, a 64-bit digest of every run's sum.
CHUNK_WORDS = 2**15  # words (64 KiB) of a run per chunk
SLICE_WORDS = 2**22  # words summed per launch: an int64 temporary of 32 MiB at most
DIGEST_HEX = 16  # hex digits per chunk digest (blake2b, 8 bytes)
_MODULUS, _MULTIPLIER, _OFFSET = 2**31 - 1, 1103515245, 12345


@functools.lru_cache(maxsize=16)
def _chunk_weights(words: int, device: torch.device) -> torch.Tensor:
    """[words] int64: each word's weight by its place in a chunk; distinct (an affine map mod a prime)."""
    place = torch.arange(words, dtype=torch.int64, device=device)
    return (place * _MULTIPLIER + _OFFSET) % _MODULUS + 1


def run_words(run: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a contiguous run [entries, ...] as int16 words [entries, words per entry]
    (e4m3 rows: pairs of bytes; an entry's byte count is even). A run may hold no entries (a
    context-parallel rank's part of a prefix shorter than the dealing's first chunk)."""
    words = torch.Size(run.shape[1:]).numel() * run.element_size() // 2
    return run.view(torch.int16).reshape(run.shape[0], words)


def chunk_entries(entry_bytes: int) -> int:
    """Entries (positions, or V blocks) a chunk of a run holds: CHUNK_WORDS words, at least one entry."""
    if entry_bytes % 2 or entry_bytes > 4 * CHUNK_WORDS:
        raise ValueError(f"cannot checksum entries of {entry_bytes} bytes")
    return max(1, 2 * CHUNK_WORDS // entry_bytes)


def chunk_sums(words: torch.Tensor, first: int, chunk: int) -> torch.Tensor:
    """The weighted sums of a run's chunks, over the part of it given: `words` [n, E] int16 are
    entries first .. first + n - 1 of the run, a chunk is `chunk` entries. -> [k] int64 on words'
    device, the sums of chunks first // chunk .. (first + n - 1) // chunk over these entries (a
    chunk read in two parts has the sum of its parts' sums)."""
    n, width = words.shape
    if n == 0:
        return torch.zeros(0, dtype=torch.int64, device=words.device)
    weights = _chunk_weights(chunk * width, words.device).view(chunk, width)
    sums, done = [], 0
    if first % chunk:  # the rest of a chunk that began before `first`
        at = first % chunk
        done = min(chunk - at, n)
        sums.append((words[:done] * weights[at : at + done]).sum().view(1))
    whole = (n - done) // chunk
    per_launch = max(1, SLICE_WORDS // (chunk * width))
    for s in range(0, whole, per_launch):
        count = min(per_launch, whole - s)
        block = words[done + s * chunk : done + (s + count) * chunk].view(count, chunk, width)
        sums.append((block * weights).sum(dim=(1, 2)))
    done += whole * chunk
    if done < n:  # a chunk that goes on past the part given (or past the run's end)
        sums.append((words[done:] * weights[: n - done]).sum().view(1))
    return torch.cat(sums)


def chunk_digests(sums: torch.Tensor) -> str:
    """[runs, chunks] int64 sums -> each chunk's digest over every run's sum, DIGEST_HEX hex digits
    a chunk, concatenated."""
    columns = sums.cpu().T.contiguous().numpy().astype("<i8")
    return "".join(hashlib.blake2b(c.tobytes(), digest_size=DIGEST_HEX // 2).hexdigest() for c in columns)


def _runs_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A stored tensor's shape with its runs on dims 0-2 and entries on dim 3 (token_ids: one run)."""
    return tuple(shape) if len(shape) >= 4 else (1, 1, 1, *shape)


def _layout_chunks(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[int, int]:
    """(entries per chunk, chunks) of a stored tensor of this shape and dtype."""
    runs_shape = _runs_shape(shape)
    chunk = chunk_entries(torch.Size(runs_shape[4:]).numel() * dtype.itemsize)
    return chunk, -(-runs_shape[3] // chunk)


# ---- the model's identity ------------------------------------------------------------------------
def config_hash(text: bytes) -> str:
    return hashlib.sha256(text).hexdigest()


@torch.no_grad()
def weights_fingerprint(model: nn.Module) -> str:
    """A hash of every byte of the weights: each parameter's name, shape and dtype, the weighted
    chunk sums of its raw bytes (chunk_sums: computed on the weights' device, one transfer in all),
    and any checkpoint KV-cache scales. Changing any one weight changes it."""
    digest, sums = hashlib.sha256(), []
    for name, p in model.named_parameters():
        digest.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
        flat = p.detach().reshape(-1)
        words = flat.view(torch.uint8).to(torch.int16) if flat.element_size() == 1 else flat.view(torch.int16)
        sums.append(chunk_sums(words.view(-1, 1), 0, CHUNK_WORDS))
    for name, module in model.named_modules():
        scales = getattr(module, "kv_static_scales", None)  # a checkpoint's k_scale / v_scale
        if scales is not None:
            digest.update(f"{name}:kv_scales:{scales};".encode())
    digest.update(torch.cat(sums).cpu().numpy().astype("<i8").tobytes())
    return digest.hexdigest()[:32]


# ---- parts: under torchrun each rank saves and reads its own --------------------------------------
# A cache saved under torchrun is one part per rank, each a whole cache file of that rank's KV heads
# (--tp) and its share of the positions (--cp: models/sharding.py's dealing, in chunks of cp_chunk
# positions): rank 0's is the path given, rank k's lies beside it as PATH.rank{k}-of-{N}. Every part
# records its place (PLACE_KEYS; a file without them is one process's) and the save's id (the same
# in every part of one save); each part is checked against the rank that reads it.
PLACE_KEYS = ("tp", "cp", "rank", "world_size", "cp_chunk")


def part_path(path: Path, rank: int, world: int) -> Path:
    """Where rank `rank` of `world` keeps its part of the cache file `path`."""
    return path if rank == 0 else path.with_name(f"{path.name}.rank{rank}-of-{world}")


def place_metadata(tp: int = 1, cp: int = 1, rank: int = 0, cp_chunk: int = CP_CHUNK) -> dict[str, str]:
    place = {"tp": tp, "cp": cp, "rank": rank, "world_size": tp * cp, "cp_chunk": cp_chunk}
    return {key: str(value) for key, value in place.items()}


def launch_name(tp: int, cp: int = 1) -> str:
    """"one process", or the options of a torchrun launch ("--tp 2")."""
    if tp * cp == 1:
        return "one process"
    return " ".join(f"--{name} {n}" for name, n in (("tp", tp), ("cp", cp)) if n > 1)


def _check_place(meta: dict[str, str], place: dict[str, str], bad: Callable[[str], UserError]) -> None:
    """Refuse a part saved under another launch, or another rank's part."""
    found = {key: meta.get(key, value) for key, value in place_metadata().items()}
    tp, cp = int(found["tp"]), int(found["cp"])
    here_tp, here_cp = int(place["tp"]), int(place["cp"])
    if (tp, cp) != (here_tp, here_cp):
        saved = "by one process" if tp * cp == 1 else f"under {launch_name(tp, cp)} (a part per rank)"
        how = (
            "in one process (without torchrun)"
            if tp * cp == 1
            else f"under torchrun --nproc-per-node {tp * cp} with {launch_name(tp, cp)}"
        )
        here = launch_name(here_tp, here_cp)
        here = here if here_tp * here_cp == 1 else f"{here} ({here_tp * here_cp} ranks)"
        raise bad(
            f"was saved {saved}, but this run is {here}: load it {how}, or prefill the prompt again "
            "and save a new cache file"
        )
    if cp > 1 and found["cp_chunk"] != place["cp_chunk"]:
        raise bad(
            f"deals its positions over the ranks in chunks of {found['cp_chunk']}, but this run deals "
            f"them in chunks of {place['cp_chunk']}: prefill the prompt again and save a new cache file"
        )
    if (found["rank"], found["world_size"]) != (place["rank"], place["world_size"]):
        raise bad(
            f"is rank {found['rank']}'s part of a {launch_name(tp, cp)} cache, but rank {place['rank']} "
            "reads it: keep the parts under the names --save-cache gave them"
        )


# ---- writing -------------------------------------------------------------------------------------
def _pieces(tensor: torch.Tensor):
    """The contiguous runs of positions: tensor[l, b, h] for every (l, b, h), in the file's
    (row-major) order."""
    for index in itertools.product(*(range(n) for n in tensor.shape[:3])):
        yield tensor[index]


def _host_buffer(tensors: list[torch.Tensor], run_bytes: int = 0) -> torch.Tensor | None:
    """One pinned staging buffer for the largest run, or `run_bytes` if more (CUDA); None on the
    CPU (no staging)."""
    if tensors[0].device.type != "cuda":
        return None
    nbytes = max(run_bytes, *(t[0, 0, 0].numel() * t.element_size() for t in tensors))
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _as_bytes(t: torch.Tensor):
    """A writable byte view (numpy array) of a contiguous CPU tensor, no copy."""
    return t.view(torch.uint8).numpy() if t.dim() else t.reshape(1).view(torch.uint8).numpy()


def _write_tensor(f, tensor: torch.Tensor, staging: torch.Tensor | None) -> torch.Tensor:
    """Write `tensor`'s runs to `f`, summing each run's chunks on its device first; -> the sums
    [runs, chunks] int64 (on the tensor's device)."""
    chunk, count = _layout_chunks(tuple(tensor.shape), tensor.dtype)
    runs = torch.Size(tensor.shape[:3]).numel()
    sums = torch.empty(runs, count, dtype=torch.int64, device=tensor.device)
    for i, piece in enumerate(_pieces(tensor)):
        sums[i] = chunk_sums(run_words(piece), 0, chunk)
        if staging is None:
            f.write(_as_bytes(piece.contiguous()))
            continue
        host = staging[: piece.numel() * piece.element_size()].view(piece.dtype).view(piece.shape)
        host.copy_(piece)  # device -> pinned host, synchronous (after the sums)
        f.write(_as_bytes(host))
    return sums


def write_cache_file(
    path: Path, tensors: dict[str, torch.Tensor], token_ids: list[int], metadata: dict[str, str]
) -> int:
    """Write `tensors` (a cache's stored tensors cut on dim 3 to positions 0..len(token_ids)-1:
    KVCache.region(0, length).tensors()) and the token ids to `path`, atomically; returns the
    file's size in bytes."""
    length = len(token_ids)
    ids = torch.tensor(token_ids, dtype=torch.int64)
    stored = {**tensors, "token_ids": ids.view(1, 1, 1, length)}
    checksums = {}
    for name, t in stored.items():  # placeholders of the digests' length, filled in at the end
        chunk, count = _layout_chunks(tuple(t.shape), t.dtype)
        checksums[name] = {"chunk": chunk, "digests": "0" * DIGEST_HEX * count}
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

    def encode() -> bytes:
        header["__metadata__"]["checksums"] = json.dumps(checksums, separators=(",", ":"))
        blob = json.dumps(header, separators=(",", ":")).encode()
        return blob + b" " * (-len(blob) % 8)  # data starts 8-byte aligned, as safetensors writes it

    blob = encode()
    staging = _host_buffer(list(tensors.values()))
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            sums = {name: _write_tensor(f, t, staging) for name, t in stored.items()}
            for name, s in sums.items():
                checksums[name]["digests"] = chunk_digests(s)
            final = encode()
            assert len(final) == len(blob)  # digests replace placeholders of their own length
            f.seek(8)
            f.write(final)
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


# ---- reading -------------------------------------------------------------------------------------
@dataclass
class CacheFile:
    """A checked cache file: its metadata, token ids, where each tensor's bytes lie, and each
    tensor's checksums."""

    path: Path
    metadata: dict[str, str]
    token_ids: list[int]
    entries: dict[str, tuple[torch.dtype, tuple[int, ...], int]]  # name -> (dtype, shape, file offset)
    checksums: dict[str, tuple[int, str]]  # name -> (entries per chunk, the chunks' digests)

    @property
    def length(self) -> int:
        return len(self.token_ids)

    def corrupted(self, name: str) -> UserError:
        return UserError(
            f"cache file {self.path} is corrupted: its {name} data does not match the checksum saved "
            "with it; prefill the prompt again and save a new cache file"
        )

    def check(self, name: str, sums: torch.Tensor) -> None:
        """Refuse the file unless the chunk sums [runs, chunks] of the first chunks of `name` match
        the checksums saved with them."""
        digests = self.checksums[name][1]
        if chunk_digests(sums) != digests[: sums.shape[1] * DIGEST_HEX]:
            raise self.corrupted(name)


def open_cache_file(
    path: Path, identity: dict[str, str], layout: Layout, place: dict[str, str] | None = None
) -> CacheFile:
    """Read and check the header of the cache file at `path`: format, version, the launch and rank
    it was saved by (`place`, place_metadata's; default one process), model identity, tensor
    names, dtypes and shapes (`layout(length)`), checksums, and that the file holds every byte
    the header promises; read the token ids and check them. Any mismatch is one UserError line.
    (The cache data is checked as read_cache_file reads it.)"""
    if path.is_dir():
        raise UserError(f"cache file {path} is a directory; give the path of a file that --save-cache wrote")
    if not path.exists():
        raise UserError(f"cache file {path} does not exist")

    def bad(why: str) -> UserError:
        return UserError(f"cache file {path} {why}")

    try:
        size = path.stat().st_size
        f = open(path, "rb")
    except OSError as e:
        raise bad(f"cannot be read: {e.strerror or e}") from None
    with f:
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
            if version < FORMAT_VERSION:
                raise bad(
                    f"was written by an older minidecode (format {version}, without the checksums of "
                    f"format {FORMAT_VERSION}): prefill the prompt again and save a new cache file"
                )
            _check_place(meta, place or place_metadata(), bad)
            for key, why in IDENTITY_ERRORS.items():
                if meta.get(key) != identity[key]:
                    raise bad(why.format(found=meta.get(key), expected=identity[key]))
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
            saved = json.loads(meta["checksums"])
            checksums = {}
            for name, (dtype, shape) in expected.items():
                chunk, count = _layout_chunks(shape, dtype)
                digests = saved[name]["digests"]
                if saved[name]["chunk"] != chunk or len(digests) != count * DIGEST_HEX:
                    raise bad(f"is corrupted ({name}: bad checksums)")
                checksums[name] = (chunk, digests)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise bad(f"is corrupted (bad header: {type(e).__name__})") from None
        if 8 + n + end != size:
            raise bad(f"is truncated or corrupted ({size:,} bytes, the header describes {8 + n + end:,})")
        ids = torch.empty(length, dtype=torch.int64)
        f.seek(entries["token_ids"][2])
        _read_exactly(f, _as_bytes(ids), path)
    file = CacheFile(path, meta, ids.tolist(), entries, checksums)
    file.check("token_ids", chunk_sums(run_words(ids), 0, checksums["token_ids"][0]).view(1, -1))
    return file


def _read_exactly(f, buffer, path: Path) -> None:
    if not buffer.nbytes:  # (a run with no entries: a context-parallel rank's part of a short prefix)
        return
    view, got = memoryview(buffer).cast("B"), 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise UserError(f"cache file {path} is truncated (it changed while being read)")
        got += n


def read_cache_file(file: CacheFile, tensors: dict[str, torch.Tensor]) -> None:
    """Fill the cache `tensors` (its stored tensors cut on dim 3 to the positions wanted, at most
    the file's: KVCache.region(0, count).tensors()) from the start of each run of `file`, one run
    at a time (through one pinned buffer on CUDA, straight in on the CPU), and check the
    checksums of what was read: whole chunks, so a run is read up to the end of the chunk that
    holds its last wanted entry (the rest is summed on the host, not copied). A mismatch is one
    UserError line, raised once the tensor is read (the cache's contents are then not valid)."""
    plans = {}
    for name, t in tensors.items():
        _, shape, offset = file.entries[name]
        chunk = file.checksums[name][0]
        entry_bytes = torch.Size(shape[4:]).numel() * t.element_size()
        want = t.shape[3]
        span = min(shape[3], -(-want // chunk) * chunk)  # entries read a run: whole chunks
        plans[name] = (offset, shape[3] * entry_bytes, entry_bytes, want, span, chunk)
    longest = max(span * entry_bytes for _, _, entry_bytes, _, span, _ in plans.values())
    staging = _host_buffer(list(tensors.values()), longest)
    most_extra = max((span - want) * entry_bytes for _, _, entry_bytes, want, span, _ in plans.values())
    spare = torch.empty(most_extra, dtype=torch.uint8)  # CPU: the rest of a run's last chunk read
    with open(file.path, "rb", buffering=0) as f:
        for name, t in tensors.items():
            offset, run_bytes, entry_bytes, want, span, chunk = plans[name]
            runs, count = torch.Size(t.shape[:3]).numel(), -(-span // chunk)
            sums = torch.zeros(runs, count, dtype=torch.int64, device=t.device)  # of the entries copied
            rest = torch.zeros(runs, count, dtype=torch.int64)  # of the entries only read (host)
            for i, piece in enumerate(_pieces(t)):
                f.seek(offset + i * run_bytes)
                if staging is None:  # straight into the cache, then the rest of the last chunk
                    _read_exactly(f, _as_bytes(piece), file.path)
                    extra = spare[: (span - want) * entry_bytes]
                    _read_exactly(f, extra.numpy(), file.path)
                else:  # the run's chunks into the pinned buffer, the wanted entries on to the device
                    host = staging[: span * entry_bytes]
                    _read_exactly(f, host.numpy(), file.path)
                    copied, extra = host[: want * entry_bytes], host[want * entry_bytes :]
                    piece.copy_(copied.view(piece.dtype).view(piece.shape))  # synchronous
                head = chunk_sums(run_words(piece), 0, chunk)
                sums[i, : head.numel()] = head
                if extra.numel():
                    tail = chunk_sums(extra.view(torch.int16).view(span - want, -1), want, chunk)
                    rest[i, want // chunk :] += tail
            file.check(name, sums.cpu() + rest)
