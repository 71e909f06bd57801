"""What this process holds of its machine, read without torch (every role may ask)."""

from __future__ import annotations

import os

__all__ = ["rss_bytes"]


def rss_bytes() -> int:
    """Resident memory of this process now (Linux /proc; the peak elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
