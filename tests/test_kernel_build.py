"""The C kernels' build and interface (skippy/model/kernels/): every vector path compiles with
warnings on and none given, and qkernel.py's ctypes mirrors of skippy_kernels.h's structures
lay out every field where the compiler does."""

from __future__ import annotations

import ctypes
import platform

import pytest

from skippy.model import qkernel

STRICT = ["-Werror", "-Wmissing-prototypes", "-Wshadow"]
# every path the sources hold, asked for explicitly: gcc builds each on any x86 machine (it need
# not run them; test_model_quant.py runs the ones this CPU has)
AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mf16c", "-mfma"]
PATHS = {"amx": [*AVX512, "-mamx-tile", "-mamx-int8", "-mamx-bf16", "-mavx512bf16"],  # bf16: the opt-in prompt path
         "vnni": [*AVX512, "-mno-amx-tile", "-mno-amx-int8"],
         "avx2": ["-mno-avx512f", "-mavx2", "-mfma", "-mf16c"], "plain": ["-mno-avx512f", "-mno-avx2"]}


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the x86 paths' flags")
@pytest.mark.parametrize("path", PATHS)
def test_every_path_builds_with_no_warning(path):
    assert "-Wall" in qkernel.FLAGS and "-Wextra" in qkernel.FLAGS
    library = qkernel.build([*qkernel.FLAGS, *STRICT, *PATHS[path]])  # KernelUnavailable, with the compiler's message, on any warning
    assert library.skippy_qmatmul_vector_path() == {"amx": 1, "vnni": 1, "avx2": 2, "plain": 0}[path]


@pytest.mark.parametrize("name", qkernel.STRUCTURES)
def test_ctypes_mirrors_lay_out_as_the_header(name):
    library, mirror = qkernel.library(), qkernel.STRUCTURES[name]
    assert library.skippy_abi_fields(name.encode()) == len(mirror._fields_), "a field on one side only"
    for field, _ in mirror._fields_:
        assert library.skippy_abi_offset(name.encode(), field.encode()) == getattr(mirror, field).offset, field
    assert library.skippy_abi_offset(name.encode(), b"") == ctypes.sizeof(mirror)
    assert library.skippy_abi_offset(name.encode(), b"no such field") == ctypes.c_size_t(-1).value
