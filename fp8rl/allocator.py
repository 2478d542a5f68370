"""The C allocator's settings for a process that runs fp8rl: freed tensor memory is kept
for reuse instead of returned to the OS and faulted back in.

Why: torch's CPU tensors come from glibc's ``malloc``. A block of at least
``M_MMAP_THRESHOLD`` bytes gets its own ``mmap``, and ``free`` unmaps it; the next
such tensor is a fresh mapping whose every 4 KiB page faults (and is zeroed by the
kernel) on first write. glibc raises the threshold to the size of a freed mapped
block ("dynamic threshold"), so a block larger than any freed before, e.g. a
tensor that grows with the sequence, is mapped afresh each time
(tests/test_allocator.py counts the faults). Below the threshold, memory freed at
the top of the heap beyond ``M_TRIM_THRESHOLD`` is returned to the OS, with the
same effect on the next allocation there. A rollout's prefill and decode steps
make tensors of many sizes, each a few MB to tens of MB.

`keep_freed_memory` sets both: blocks up to 32 MiB (the ceiling of glibc's own
dynamic threshold on 64-bit) come from the heap, and the heap is not
trimmed below 1 GiB of free top. Peak memory is unchanged (the same tensors are
live at the peak); memory freed after the peak stays with the process. Measured
side by side by benchmarks/allocator.py (a SmolLM2 rollout 1.20x faster on a
2-core AMD EPYC, peak RSS the same). Tensors over 32 MiB are still mapped. The
CLI calls it once at start; the arithmetic, hence every result bit, is unchanged.
"""

from __future__ import annotations

import ctypes
import sys

# mallopt parameter numbers (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

# glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit; 256 MiB gave a SmolLM2 rollout 1% more here (noise)
MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 1 << 30


def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds (module docstring) for this process.
    Returns whether they were set: False on a C library other than glibc (macOS,
    musl), where nothing is changed. Setting either fixes glibc's otherwise
    dynamic mmap threshold."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None)  # the symbols already loaded into this process, the C library's included
    if not hasattr(libc, "gnu_get_libc_version"):  # musl: its mallopt accepts nothing
        return False
    mmap_set = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    trim_set = libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    return mmap_set and trim_set
