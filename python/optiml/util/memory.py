"""What the operating system offers a model's weights: the memory still available to this process (under a
container's cgroup limit too) and whether Linux transparent huge pages may back a private copy."""

from __future__ import annotations

import os

__all__ = ["huge_pages_allowed", "memory_available"]


def huge_pages_allowed() -> bool:
    """Linux transparent huge pages in "always" or "madvise" mode (the native reader advises them)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def memory_available() -> int | None:
    """Bytes this process can still take: MemAvailable of /proc/meminfo (free memory plus the page cache
    the kernel can drop, such as a model file's pages once it was read into memory), else the free pages
    sysconf reports, lowered to the room left under a cgroup memory limit (a container's --memory) where
    there is one. None where nothing says."""
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    if available is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            pass
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        limit, usage = _read_int(limit_file), _read_int(usage_file)  # "max" (no limit) reads as None
        if limit is not None and usage is not None and limit < 1 << 60:
            room = max(0, limit - usage)
            available = room if available is None else min(available, room)
            break
    return available
