"""Native CPU kernels: C files beside their Python wrappers, compiled on first use with the
host compiler (`-O3 -march=native`, so the vector width and instructions are the machine's)
into a cache directory keyed by the source, the flags and the CPU, and called through
ctypes. OpenMP inside them resolves to the libgomp torch has already loaded, so they share
its threads. Without a compiler a kernel is unavailable and its callers keep the torch path.

    SPLITSTACK_KERNEL_CACHE       where built kernels are kept (default ~/.cache/splitstack)
    SPLITSTACK_NATIVE_KERNELS=0   never build or load them
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared")


def cpu_flags() -> set[str]:
    try:
        line = next((line for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("flags")), "")
    except OSError:
        return set()
    return set(line.split(":", 1)[1].split()) if ":" in line else set()


def _cache_dir() -> Path:
    root = os.environ.get("SPLITSTACK_KERNEL_CACHE") or Path.home() / ".cache" / "splitstack"
    path = Path(root) / "kernels"
    try:
        path.mkdir(parents=True, exist_ok=True)
        if os.access(path, os.W_OK):
            return path
    except OSError:
        pass
    path = Path(tempfile.gettempdir()) / "splitstack-kernels"   # a read-only home (containers)
    path.mkdir(parents=True, exist_ok=True)
    return path


def build(source: Path, flags: tuple[str, ...] = FLAGS,
          libs: tuple[str, ...] = ("-lm",)) -> Path:
    """Compile `source` (once per source, flags, libraries and CPU; a `.cpp` source with the C++
    compiler) and link it with `libs`; returns the library's path."""
    text = source.read_bytes()
    key = platform.machine() + " ".join(sorted(cpu_flags()))
    digest = hashlib.sha256(text + " ".join((*flags, *libs)).encode()
                            + key.encode()).hexdigest()
    target = _cache_dir() / f"{source.stem}-{digest[:16]}.so"
    if target.exists():
        return target
    if source.suffix == ".cpp":
        cc = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    else:
        cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError(f"no compiler for {source.name} on PATH")
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([cc, *flags, str(source), "-o", tmp, *libs], check=True,
                       capture_output=True, text=True, timeout=300)
        os.replace(tmp, target)        # atomic: concurrent builders (Ray actors) never clash
    except subprocess.CalledProcessError as err:
        raise RuntimeError(f"building {source.name} failed: {err.stderr.strip()}") from err
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load(source: Path, declare: Callable[[ctypes.CDLL], None],
         flags: tuple[str, ...] = FLAGS) -> ctypes.CDLL | None:
    """The library of `source` with `declare(lib)` run on it (argtypes), or None (logged)
    when it cannot be built or native kernels are switched off."""
    if os.environ.get("SPLITSTACK_NATIVE_KERNELS", "1") == "0":
        return None
    try:
        lib = ctypes.CDLL(str(build(source, flags)))
        declare(lib)
        return lib
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        log.warning("native kernel %s unavailable (%s); using torch", source.name, err)
        return None
