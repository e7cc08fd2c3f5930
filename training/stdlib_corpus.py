"""The training corpus of the shipped tiny model: the Python standard library's own sources.

Every Python installation carries its standard library as plain `.py` files, under the Python
Software Foundation licence, so this corpus needs no download and is the same on every machine that
runs the same Python version. The helpers here are shared by the training script and the tests:

- `list_stdlib_files` lists the `.py` files of the running interpreter's stdlib (or of another stdlib
  tree), sorted by their path relative to the stdlib root (third-party `site-packages` /
  `dist-packages` and build-generated `_sysconfigdata*` / `config-*` files left out);
- `split_of` puts each file in "train", "valid" or "heldout" by a hash of that relative path, so a
  file lands in the same split on every Python version and platform;
- `read_source` reads one file as text.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from pathlib import Path

# Directories that hold third-party packages (or byte code), never the standard library itself.
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
# Files written when the interpreter was built (build settings and install paths of one machine),
# not CPython sources: `_sysconfigdata_*.py` and everything under `config-3.X-<platform>/`.
_GENERATED_FILE_PREFIX = "_sysconfigdata"
_GENERATED_DIR_PREFIX = "config-"

# One file in SPLIT_MODULUS goes to "heldout" (hash remainder 0) and one to "valid" (remainder 1):
# about 2% each. "heldout" is only ever used to report the final loss; "valid" picks the checkpoint.
SPLIT_MODULUS = 50
SPLITS = ("train", "valid", "heldout")


def stdlib_root() -> Path:
    """The running interpreter's standard-library directory (the one holding os.py)."""
    return Path(sysconfig.get_paths()["stdlib"])


def list_stdlib_files(root: Path | None = None) -> list[str]:
    """Relative POSIX paths of every `.py` file under the stdlib root, sorted.

    Third-party package folders and the build-generated configuration files are skipped wherever they
    sit. Symbolic links to directories are not followed, so the listing stays inside the stdlib tree.
    """
    root = stdlib_root() if root is None else Path(root)
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune in place so os.walk does not descend into skipped folders.
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(_GENERATED_DIR_PREFIX)]
        rel_dir = Path(dirpath).relative_to(root)
        for name in filenames:
            if name.startswith(_GENERATED_FILE_PREFIX):
                continue
            if name.endswith(".py") and os.path.isfile(os.path.join(dirpath, name)):
                found.append((rel_dir / name).as_posix())
    return sorted(found)


def split_of(relpath: str) -> str:
    """ "train", "valid" or "heldout" for a stdlib-relative POSIX path, by its SHA-1."""
    remainder = int(hashlib.sha1(relpath.encode("utf-8")).hexdigest(), 16) % SPLIT_MODULUS
    if remainder == 0:
        return "heldout"
    if remainder == 1:
        return "valid"
    return "train"


def read_source(relpath: str, root: Path | None = None) -> str:
    """The file's text. Decoded as UTF-8 (the default source encoding); the few test files that are
    deliberately in another encoding get replacement characters rather than an error."""
    root = stdlib_root() if root is None else Path(root)
    return (root / relpath).read_bytes().decode("utf-8", errors="replace")


def files_of_split(split: str, root: Path | None = None) -> list[str]:
    """The sorted relative paths of one split."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, not {split!r}")
    return [p for p in list_stdlib_files(root) if split_of(p) == split]


def load_split(
    split: str, root: Path | None = None, max_files: int | None = None, max_chars: int | None = None
) -> tuple[list[str], list[str]]:
    """(relative paths, texts) of one split, in sorted order, optionally only the first files.

    `max_files` and `max_chars` cut the list after that many files / characters in total (the file
    that crosses `max_chars` is kept whole); the smoke run and the tests use them to stay fast.
    """
    paths, texts, total = [], [], 0
    for relpath in files_of_split(split, root):
        if max_files is not None and len(paths) >= max_files:
            break
        if max_chars is not None and total >= max_chars:
            break
        text = read_source(relpath, root)
        paths.append(relpath)
        texts.append(text)
        total += len(text)
    return paths, texts
