"""Releasing library pages (skippy/model/resident.py): only clean library mappings,
and the process keeps working with less resident memory."""

from __future__ import annotations

import subprocess
import sys

import pytest

from skippy.model.resident import clean_library_mappings

SMAPS = """\
7f0000000000-7f0000400000 r-xp 00000000 08:01 123 /usr/lib/libtorch_cpu.so
Rss:                1024 kB
Anonymous:             0 kB
7f0000400000-7f0000401000 r--p 00400000 08:01 123 /usr/lib/libtorch_cpu.so
Rss:                   4 kB
Anonymous:             4 kB
7f0000401000-7f0000402000 rw-p 00401000 08:01 123 /usr/lib/libtorch_cpu.so
Anonymous:             4 kB
7f0000500000-7f0000600000 r--p 00000000 08:01 124 /models/model.gguf
Anonymous:             0 kB
7f0000600000-7f0000700000 rw-p 00000000 00:00 0
Anonymous:          1024 kB
7f0000700000-7f0000710000 r-xp 00000000 08:01 125 /usr/lib/libc.so.6
Anonymous:             0 kB
"""


def test_only_clean_read_only_library_mappings_are_chosen():
    assert clean_library_mappings(SMAPS) == [(0x7F0000000000, 0x7F0000400000), (0x7F0000700000, 0x7F0000710000)]


CHECK = """
import re, torch
from skippy.model.resident import release_library_pages

def resident_mib():
    return int(re.search(r"VmRSS:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) / 1024

x = torch.randn(64, 64)
expected = (x @ x).softmax(-1)
before = resident_mib()
assert release_library_pages() > 0
after = resident_mib()
assert torch.equal((x @ x).softmax(-1), expected)  # code pages fault back in from the files
print(before - after)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_released_pages_come_back_when_needed():
    """In a fresh process, after `import torch`: its start-up code is resident (tens of MiB)."""
    done = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert float(done.stdout) > 10
