"""Did a docs rewrite lose a figure? Every number in an old version of a document must still be
somewhere: in docs/decisions.md, in a benchmark's source (bench/*.py), or in today's docs.

    python tests/doc_figures.py 2eb265f:docs/architecture.md 2eb265f:README.md

prints, for each old document, how many of its distinct numbers each place holds, and every
number found nowhere with the words around it; it exits 1 if any is missing. A run-once check for
a rewrite (it reads the old text from git history, so it is no test: a shallow clone has none).
Numbers are matched as written ("1,000" as 1000); digits inside names (Q4_1, AVX2, int8) are
not numbers.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NUMBER = re.compile(r"(?<![A-Za-z_\d.,])\d+(?:[.,]\d+)*")
PLACES = {
    "decisions.md": ["docs/decisions.md"],
    "bench/*.py": sorted(str(p.relative_to(ROOT)) for p in (ROOT / "bench").glob("*.py")),
    "today's docs": ["README.md", "docs/architecture.md", "docs/usage.md", "docs/operations.md",
                     "docs/protocol.md"],
}


def normal(number: str) -> str:
    return number.replace(",", "") if re.fullmatch(r"\d{1,3}(,\d{3})+", number) else number


def numbers(text: str) -> set[str]:
    return {normal(m.group()) for m in NUMBER.finditer(text)}


def check(old_spec: str) -> list[str]:
    ref, _, path = old_spec.partition(":")
    old = subprocess.run(["git", "show", f"{ref}:{path}"], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout
    wanted = numbers(old)
    held = {place: numbers("\n".join((ROOT / f).read_text() for f in files)) for place, files in PLACES.items()}
    missing, counts, left = [], {}, set(wanted)
    for place, found in held.items():
        counts[place] = len(left & found)
        left -= found
    for number in sorted(left, key=lambda n: float(n.replace(",", "").split(".")[0] or 0)):
        where = next(m for m in NUMBER.finditer(old) if normal(m.group()) == number)
        context = " ".join(old[max(0, where.start() - 60):where.end() + 40].split())
        missing.append(f"  {number}: ...{context}...")
    print(f"{old_spec}: {len(wanted)} distinct numbers; " + ", ".join(f"{n} in {p}" for p, n in counts.items())
          + f"; {len(left)} nowhere")
    return missing


def main(specs: list[str]) -> int:
    missing = [line for spec in specs for line in check(spec)]
    print("\n".join(missing))
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["2eb265f:docs/architecture.md"]))
