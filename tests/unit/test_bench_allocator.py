"""scripts/bench_lib/allocator.py: the benchmark process takes the replicas' malloc settings (a child process
per case, so that this one's allocator stays as it is)."""

from __future__ import annotations

import ctypes.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"

# six threads alive at once, each with a malloc of its own -> the arenas glibc then holds (malloc_info's heaps)
CHILD = textwrap.dedent("""
    import ctypes, re, sys, tempfile, threading
    sys.path.insert(0, {scripts!r})
    if {apply}:
        from bench_lib.allocator import malloc_as_replicas
        print(sorted(malloc_as_replicas()))
    else:
        print([])
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.fopen.restype = ctypes.c_void_p, ctypes.c_void_p
    started, done = threading.Barrier(7), threading.Event()
    def work():
        libc.malloc(1 << 20)
        started.wait()
        done.wait()
    threads = [threading.Thread(target=work) for _ in range(6)]
    for t in threads:
        t.start()
    started.wait()
    with tempfile.NamedTemporaryFile(suffix=".xml") as f:
        fp = libc.fopen(f.name.encode(), b"w")
        libc.malloc_info(0, ctypes.c_void_p(fp))
        libc.fclose(ctypes.c_void_p(fp))
        print(len(re.findall(r"<heap nr=", open(f.name).read())))
    done.set()
""")


def arenas(apply: bool) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", CHILD.format(scripts=str(SCRIPTS), apply=apply)],
                         capture_output=True, text=True, check=True).stdout.split("\n")
    return out[0], int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux") or "libc.so" not in (ctypes.util.find_library("c") or ""),
                    reason="glibc's mallopt and malloc_info")
def test_the_benchmark_process_takes_the_replicas_malloc_settings_and_their_arena_cap():
    applied, capped = arenas(apply=True)
    assert applied == str(sorted(["MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"]))
    assert capped <= 2
    _, uncapped = arenas(apply=False)  # glibc's default: an arena for each thread, up to 8 per core
    assert uncapped > capped
