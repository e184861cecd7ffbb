"""The real task's data: the Python standard library's own sources, as one byte string.

Text that ships with every Python, so the task needs no download: the ``.py`` files
under ``sysconfig.get_paths()["stdlib"]``, in a fixed order (sorted by their path
relative to the library's root), tests and installed third-party packages left out
(some distributions strip the tests, so they would make the text differ between
installs of the same version), concatenated with a newline after each file and cut
at ``size`` bytes. Bytes above 127 (non-ASCII text in a few files) become 127, so the
alphabet is the 128 ASCII codes.

The last ``val_fraction`` of the text is the validation set; the rest is cut into one
contiguous shard per rank. A batch is ``batch`` windows of ``context + 1`` bytes at
offsets drawn from a generator seeded by ``(seed, rank, step)``: every contender sees
the same batches at the same step, whatever else it did, and a rerun sees them again.

The same Python version gives the same text: :attr:`StdlibText.digest` identifies it.
"""
from __future__ import annotations

import hashlib
import os
import sysconfig
from pathlib import Path
from typing import List, Optional, Tuple

import torch
from torch import Tensor

__all__ = ["VOCAB", "stdlib_sources", "read_stdlib_text", "StdlibText"]

#: The alphabet: ASCII; every byte above 127 is mapped to 127.
VOCAB = 128

# Directories left out: tests (stripped by some distributions) and what pip installed.
_SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})


def stdlib_sources(root: Optional[Path] = None) -> List[Path]:
    """The standard library's ``.py`` files, sorted by their path relative to ``root``.

    Args:
        root: the library's directory (default: ``sysconfig.get_paths()["stdlib"]``).

    Returns:
        The files' paths.

    Raises:
        FileNotFoundError: ``root`` holds no ``.py`` file.
    """
    root = Path(sysconfig.get_paths()["stdlib"]) if root is None else Path(root)
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        files += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    if not files:
        raise FileNotFoundError(f"no .py files under {root}; the task needs the standard library's sources")
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def read_stdlib_text(size: int, root: Optional[Path] = None) -> bytes:
    """The first ``size`` bytes of the library's sources in :func:`stdlib_sources` order.

    Args:
        size: bytes wanted.
        root: the library's directory (default: the running Python's).

    Returns:
        ``size`` bytes of ASCII (bytes above 127 replaced by 127).

    Raises:
        ValueError: ``size`` is not positive, or the sources are shorter.
    """
    if size <= 0:
        raise ValueError(f"size={size!r} must be a positive number of bytes")
    chunks, total = [], 0
    for path in stdlib_sources(root):
        data = path.read_bytes() + b"\n"
        chunks.append(data)
        total += len(data)
        if total >= size:
            break
    if total < size:
        raise ValueError(f"size={size} is more than the {total} bytes of sources found; ask for less")
    text = b"".join(chunks)[:size]
    return text.translate(bytes(range(128)) + bytes([127]) * 128)


class StdlibText:
    """The text as token tensors: a train shard per rank, a validation set, batches by step.

    Args:
        size: bytes of sources to read (default: 3 MB).
        val_fraction: the share at the end kept for validation (default: 0.1).
        root: the library's directory (default: the running Python's).

    Attributes:
        train: the training tokens (int64).
        val: the validation tokens (int64).
        digest: the first 12 hex digits of the text's SHA-256, to tell texts apart.
    """

    def __init__(self, size: int = 3_000_000, val_fraction: float = 0.1, root: Optional[Path] = None) -> None:
        if not 0 < val_fraction < 1:
            raise ValueError(f"val_fraction={val_fraction!r} must be between 0 and 1")
        text = read_stdlib_text(size, root)
        self.digest = hashlib.sha256(text).hexdigest()[:12]
        tokens = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
        split = int(len(tokens) * (1 - val_fraction))
        self.train, self.val = tokens[:split], tokens[split:]

    def shard(self, rank: int, world: int) -> Tensor:
        """Rank ``rank``'s contiguous share of the training tokens.

        Raises:
            ValueError: ``rank`` is not in ``range(world)``.
        """
        if not 0 <= rank < world:
            raise ValueError(f"rank={rank!r} must be in range(world={world})")
        per = len(self.train) // world
        return self.train[rank * per:(rank + 1) * per]

    def batch(self, rank: int, world: int, step: int, batch: int, context: int, seed: int = 0) -> Tuple[Tensor, Tensor]:
        """Rank ``rank``'s batch at ``step``: inputs and next-byte targets, ``(batch, context)`` each.

        Args:
            rank: whose shard to draw from.
            world: how many shards there are.
            step: the training step (with ``seed`` and ``rank``, it seeds the draw).
            batch: windows per batch.
            context: tokens per window.
            seed: the run's seed.
        """
        shard = self.shard(rank, world)
        gen = torch.Generator().manual_seed((seed * 1_000_003 + rank) * 1_000_003 + step)
        starts = torch.randint(0, len(shard) - context - 1, (batch,), generator=gen)
        windows = torch.stack([shard[s:s + context + 1] for s in starts.tolist()])
        return windows[:, :-1], windows[:, 1:]

    def val_batches(self, count: int, batch: int, context: int) -> List[Tuple[Tensor, Tensor]]:
        """``count`` fixed validation batches, windows evenly spaced over the validation set.

        Raises:
            ValueError: the validation set is too short for them.
        """
        windows = count * batch
        stride = (len(self.val) - context - 1) // max(1, windows)
        if stride < 1:
            raise ValueError(f"{windows} validation windows of {context + 1} bytes do not fit in "
                             f"{len(self.val)} validation bytes; ask for fewer or a larger text")
        starts = [i * stride for i in range(windows)]
        out = []
        for b in range(count):
            chunk = torch.stack([self.val[s:s + context + 1] for s in starts[b * batch:(b + 1) * batch]])
            out.append((chunk[:, :-1], chunk[:, 1:]))
        return out
