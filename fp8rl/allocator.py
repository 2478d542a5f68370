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

`keep_freed_memory` turns glibc's mmap path off (``M_MMAP_MAX`` = 0): every block,
however large, comes from the heap; and it turns trimming off (``M_TRIM_THRESHOLD`` =
-1): the heap keeps the memory of its peak. Blocks above 32 MiB (the most
``M_MMAP_THRESHOLD`` accepts on 64-bit) matter as much as the small ones: a SmolLM2
training step makes a dozen vocabulary-sized tensors (logits and their gradient,
[1008 x 49152] float32 = 198 MB each; the head's weight gradient and AdamW
temporaries), 300,000 page faults, about 1 s, per step when each is mapped afresh.
Trimming matters as much: a step with one micro-batch frees over 1 GiB at the top of
the heap at its end, and a trimmed heap faults it back in during the next step
(`benchmarks/allocator.py --jobs step`, 2-core Xeon with AMX, 2026-12-06: up to 298,000
faults a step and 5.03 s of training per step with a 1 GiB trim threshold, under 50
faults once at the peak and 4.47 s with none). Peak memory is
unchanged (the same tensors are live at the peak); memory freed after the peak stays
with the process for the next step, which needs it again. Measured side by side by
benchmarks/allocator.py. The CLI calls it once at start; the arithmetic, hence every
result bit, is unchanged.
"""

from __future__ import annotations

import ctypes
import sys

# mallopt parameter numbers (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4

# glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit. With M_MMAP_MAX = 0 nothing is mapped, but
# setting the threshold also fixes glibc's dynamic one, which would move the trim threshold.
MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_NEVER = -1  # mallopt(3): "Setting M_TRIM_THRESHOLD to -1 disables trimming completely"


def keep_freed_memory() -> bool:
    """Turn glibc's mmap path and heap trimming off (module docstring) for this
    process. Returns whether they were set: False on a C
    library other than glibc (macOS, musl), where nothing is changed."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None)  # the symbols already loaded into this process, the C library's included
    if not hasattr(libc, "gnu_get_libc_version"):  # musl: its mallopt accepts nothing
        return False
    mmap_set = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    trim_set = libc.mallopt(M_TRIM_THRESHOLD, TRIM_NEVER) == 1
    no_mmap = libc.mallopt(M_MMAP_MAX, 0) == 1
    return mmap_set and trim_set and no_mmap
