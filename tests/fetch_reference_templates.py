"""Fetch real model chat templates for tests/test_reference_templates.py, once, at install time.

llama.cpp keeps copies of real models' templates (Qwen3, Qwen2.5, Llama 3.x, Mistral Nemo, ...)
for its own tests, and llama-cpp-python's sdist on the package index carries them. We may not
copy them into this repository, so README's test command runs this script: it downloads that
sdist (76 MB, nothing is built) and writes only the `.jinja` files to the git-ignored
`.cache/templates/` of the checkout. A complete folder from an earlier run is kept as is.

    python tests/fetch_reference_templates.py
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

SDIST = "llama-cpp-python==0.3.36"
TEMPLATES_IN_SDIST = "/vendor/llama.cpp/models/templates/"
DESTINATION = Path(__file__).resolve().parent.parent / ".cache" / "templates"
MARKER = ".source"  # written last: the folder is complete when it names this SDIST


def is_complete(folder: Path = DESTINATION) -> bool:
    marker = folder / MARKER
    return marker.is_file() and marker.read_text().strip() == SDIST


def fetch(folder: Path = DESTINATION) -> int:
    """Download the sdist and write its templates into `folder`; the number written."""
    staging = folder.with_name(folder.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as download:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                        SDIST, "-d", download], check=True)
        (archive,) = Path(download).glob("*.tar.gz")
        count = 0
        with tarfile.open(archive, "r:gz") as tar:
            for member in tar:  # streamed: one pass over the archive
                if member.isfile() and TEMPLATES_IN_SDIST in member.name and member.name.endswith(".jinja"):
                    # Only the base name is kept, so no member can write outside the folder.
                    (staging / Path(member.name).name).write_bytes(tar.extractfile(member).read())
                    count += 1
    if count == 0:
        raise SystemExit(f"{SDIST} carried no templates under {TEMPLATES_IN_SDIST}")
    (staging / MARKER).write_text(SDIST + "\n")
    shutil.rmtree(folder, ignore_errors=True)
    staging.rename(folder)
    return count


def main() -> None:
    if is_complete():
        print(f"reference templates: present in {DESTINATION}")
        return
    count = fetch()
    print(f"reference templates: {count} from {SDIST} in {DESTINATION}")


if __name__ == "__main__":
    main()
