"""Give back resident pages this process will not read again (or can read back).

`drop_pages` is the one madvise call: the GGUF's pages after packing
(quant.drop_resident_pages) and library code that ran once (below).

Importing torch executes and reads ~60 MiB of its shared libraries (static
initializers registering every operator, Python bindings); those pages stay
resident although a decode step runs a small part of them. They are clean file
pages, so dropping them costs nothing but a minor fault for a page that is needed
again, and a decode step touches few of them (docs/decisions.md). Only mappings that hold no private
(written) page are touched: dropping one of those would lose what was written,
relocations for instance.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import re

log = logging.getLogger(__name__)

_MAPPING = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S+) \S+ \S+ \S+\s*(.*)$")


def clean_library_mappings(smaps_text: str) -> list[tuple[int, int]]:
    """(start, end) of every read-only, file-backed shared-library mapping with no
    private page, from /proc/<pid>/smaps text."""
    found, current = [], None
    for line in smaps_text.splitlines():
        if match := _MAPPING.match(line):
            start, end, perms, path = match.groups()
            is_library = ".so" in path.rsplit("/", 1)[-1] and path.startswith("/")
            current = (int(start, 16), int(end, 16)) if is_library and "w" not in perms else None
        elif current is not None and line.startswith("Anonymous:"):
            if int(line.split()[1]) == 0:
                found.append(current)
            current = None
    return found


def drop_pages(start: int, length: int) -> bool:
    """MADV_DONTNEED on [start, start + length) (page-aligned): clean file pages fault
    back in from the page cache when read again. False where madvise is unavailable or
    refuses."""
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):  # no madvise here: the pages stay resident
        return False
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return madvise(ctypes.c_void_p(start), length, mmap.MADV_DONTNEED) == 0


def release_library_pages() -> int:
    """Drop this process's resident pages of clean shared-library mappings (Linux);
    returns the bytes of address space advised. Anywhere else, nothing happens."""
    try:
        with open("/proc/self/smaps") as smaps:
            mappings = clean_library_mappings(smaps.read())
    except OSError:
        return 0
    released = sum(end - start for start, end in mappings if drop_pages(start, end - start))
    log.debug("released the resident pages of %d MiB of library mappings", released >> 20)
    return released
