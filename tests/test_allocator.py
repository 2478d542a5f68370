"""fp8rl/allocator.py: freed tensor memory is reused without page faults, and the CLI
sets it. Each check runs in a fresh interpreter: the settings are process-wide."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")

# Allocates, writes and frees a block of MiB mebibytes (MiB * 256 pages) 20 times, each 4 KiB
# larger than the last (a tensor that grows with the sequence), and prints the minor page faults
# of the last 10: glibc maps a block larger than any freed before afresh, and every block over
# 32 MiB (its largest mmap threshold) always. Through libc's posix_memalign (what torch's CPU
# allocator calls for a tensor's data) rather than torch tensors: a tensor's small metadata,
# allocated next to its data, can land above it and keep the freed block from merging with the
# top of the heap, so that the next, larger block extends the heap instead (seen once in a CI
# run: 4 such blocks of 10); that depends on where glibc put a few small objects, not on the
# setting tested here.
FAULTS = """
import ctypes, resource, sys
from fp8rl.allocator import keep_freed_memory
if sys.argv[1] == "kept":
    assert keep_freed_memory()
libc = ctypes.CDLL(None)
libc.posix_memalign.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_size_t]
libc.memset.argtypes, libc.memset.restype = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t], ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
block = ctypes.c_void_p()
for i in range(20):
    if i == 10:
        start = faults()
    size = int(sys.argv[2]) * (1 << 20) + i * 4096
    assert libc.posix_memalign(ctypes.byref(block), 64, size) == 0
    libc.memset(block, 1, size)
    libc.free(block)
print(faults() - start)
"""


def minor_faults(mode: str, mib: int) -> int:
    out = subprocess.run([sys.executable, "-c", FAULTS, mode, str(mib)], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.parametrize("mib", [16, 64])  # below and above glibc's largest mmap threshold (32 MiB)
def test_kept_memory_is_reused_without_page_faults(mib: int) -> None:
    pages = mib * 256
    default, kept = minor_faults("default", mib), minor_faults("kept", mib)
    assert default > 10 * pages * 0.9, default  # every page of every tensor, under glibc's defaults
    assert kept < pages, kept  # fewer than one tensor's pages, for all ten


# mallocs and frees a block of 1.25 GiB (never written: no page is touched) at the top of the
# heap, as the last of a training step's large tensors is, and prints the heap's size
# afterwards (mallinfo2's `arena`): given back to the OS unless trimming is off. Through libc
# itself: a torch tensor's small metadata, allocated after its data, would sit above it.
HEAP_AFTER_FREE = """
import ctypes, sys
from fp8rl.allocator import M_TRIM_THRESHOLD, keep_freed_memory
assert keep_freed_memory()
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                     "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
if sys.argv[1] == "trim-1GiB":  # the setting before trimming was turned off
    assert libc.mallopt(M_TRIM_THRESHOLD, 1 << 30) == 1
block = libc.malloc(5 << 28)
assert block
libc.free(block)
print(libc.mallinfo2().arena)
"""


@pytest.mark.parametrize("mode", ["kept", "trim-1GiB"])
def test_the_heap_keeps_its_peak(mode: str) -> None:
    """A training step frees over 1 GiB at the top of the heap at its end and allocates it
    again in the next step: trimmed, every page of it faults again (fp8rl/allocator.py)."""
    import ctypes

    if not hasattr(ctypes.CDLL(None), "mallinfo2"):
        pytest.skip("mallinfo2 needs glibc 2.33 or newer")
    out = subprocess.run([sys.executable, "-c", HEAP_AFTER_FREE, mode], capture_output=True, text=True, check=True)
    heap = int(out.stdout.split()[-1])
    if mode == "kept":
        assert heap >= 5 << 28, heap  # the freed 1.25 GiB is still the heap's
    else:
        assert heap < 1 << 30, heap  # the check can fail: a 1 GiB trim threshold gives it back


def test_the_cli_keeps_freed_memory(tmp_path, monkeypatch) -> None:
    from fp8rl import cli

    calls = []
    monkeypatch.setattr(cli, "keep_freed_memory", lambda: calls.append(1) or True)
    assert cli.main(["train", "--config", str(tmp_path / "missing.toml")]) == 2  # a command that runs, then fails
    assert calls == [1]
