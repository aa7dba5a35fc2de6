"""A stage's slice of a GGUF (model/source.py, slice.py, partial_slice.py): which tensors it
takes, that it is a GGUF any reader loads and that computes what the whole file computes,
that it checks itself (a flipped byte is named), and that a partial one resumes and is never
taken for a finished one."""

from __future__ import annotations

import json
import os

import gguf
import pytest
import torch

from architecture_support import CASES, build_reference, prompts, write_gguf
from skippy.model.errors import ModelLoadError
from skippy.model.gguf_file import GGUFFile
from skippy.model.llama import Segment
from skippy.model.loader import load_stage
from skippy.model.partial_slice import RECORD, PartialSlice, SliceIntegrityError
from skippy.model.slice import plan_slice, slice_file_name, verify_slice
from skippy.model.source import DIGESTS_SUFFIX, SourceModel

RANGES = [(0, 1), (1, 2), (2, 3)]


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> SourceModel:
    """Llama 3 in three layers: an untied head and a rope_freqs tensor outside the blocks."""
    case = CASES["llama3"]
    path = write_gguf(case, build_reference(case), tmp_path_factory.mktemp("llama3") / "model.gguf")
    return SourceModel.open(path)


def fetch_locally(source: SourceModel, start: int, end: int, directory, *, stop_after: int | None = None):
    """The slice written as a fetch writes it, the bytes read from the source file; with
    `stop_after`, it stops (as a killed stage would) after that many tensors' first halves."""
    layout = plan_slice(source.header, source.size, source.fingerprint, source.digests, start, end)
    partial = PartialSlice(directory / slice_file_name(start, end), layout)
    with source.path.open("rb") as handle:
        for n, (position, first) in enumerate(partial.missing()):
            tensor = layout.tensors[position]
            handle.seek(source.index.data_start + source.index.tensors[tensor.source_index].offset + first)
            data = handle.read(tensor.n_bytes - first)
            if stop_after is not None and n >= stop_after:
                partial.write(position, first, data[: len(data) // 2])
                partial.close()
                return partial
            partial.write(position, first, data)
    return partial


def test_slices_cover_the_model_once_and_take_what_a_stage_loads(source):
    names = [t.name for t in source.index.tensors]
    taken = [[names[i] for i in source.slice_indices(start, end)] for start, end in RANGES]
    assert set(taken[0][:2]) == {"token_embd.weight", "rope_freqs.weight"}  # the embedding, and model-wide ones
    assert all("rope_freqs.weight" in names for names in taken)
    assert all(name.startswith(("blk.2.", "output")) or name == "rope_freqs.weight" for name in taken[2])
    assert {"output.weight", "output_norm.weight"} <= set(taken[2])
    assert sorted(n for slice_ in taken for n in slice_ if n != "rope_freqs.weight") == sorted(
        n for n in names if n != "rope_freqs.weight")


def test_a_slice_is_a_gguf_that_computes_what_the_whole_file_computes(source, tmp_path):
    paths = [fetch_locally(source, start, end, tmp_path).finish() for start, end in RANGES]
    for path, (start, end) in zip(paths, RANGES):
        verify_slice(path, source.fingerprint, start, end)
        ours, reference = GGUFFile(path), gguf.GGUFReader(str(path))  # any reader loads it
        assert [t.name for t in reference.tensors] == [t.name for t in ours.tensors]
        whole = {t.name: t for t in GGUFFile(source.path).tensors}
        for tensor in ours.tensors:
            assert tensor.data.tobytes() == whole[tensor.name].data.tobytes(), tensor.name
        assert {k: v for k, v in ours.fields.items() if not k.startswith("skippy.")} == GGUFFile(source.path).fields
    prompt = prompts()[1]

    def staged(files) -> torch.Tensor:
        x = torch.tensor(prompt)
        for file, (start, end) in zip(files, RANGES):
            model = load_stage(file, (start, end), device="cpu", progress=False)
            x = model.forward(x, [Segment(model.new_cache(), 0, len(prompt))])
        return model.compute_logits(x)

    assert torch.equal(staged(paths), staged([source.path] * 3))  # rope_freqs and the untied head came along


def test_a_flipped_byte_is_refused_naming_the_tensor(source, tmp_path):
    path = fetch_locally(source, 1, 2, tmp_path).finish()
    index = GGUFFile(path)
    victim = index.tensors[3]
    at = index.header_bytes + (victim.data.ctypes.data - index.tensors[0].data.ctypes.data) + 5
    del index
    original = path.read_bytes()
    with path.open("r+b") as handle:
        handle.seek(at)
        handle.write(bytes([original[at] ^ 0x01]))
    with pytest.raises(ModelLoadError, match=f"tensor {victim.name} does not match its digest.*Fix: delete"):
        verify_slice(path, source.fingerprint, 1, 2)
    path.write_bytes(original)
    metadata_at = 64  # inside the copied metadata (general.architecture's key)
    with path.open("r+b") as handle:
        handle.seek(metadata_at)
        handle.write(bytes([original[metadata_at] ^ 0x01]))
    with pytest.raises(ModelLoadError, match="metadata or tensor table does not match"):
        verify_slice(path, source.fingerprint, 1, 2)
    path.write_bytes(original)
    with pytest.raises(ModelLoadError, match="slice of another model"):
        verify_slice(path, "0" * 32, 1, 2)
    with pytest.raises(ModelLoadError, match="holds layers"):
        verify_slice(path, source.fingerprint, 0, 1)
    path.write_bytes(original[:-1])
    with pytest.raises(ModelLoadError, match="truncated"):
        verify_slice(path, source.fingerprint, 1, 2)


def test_a_partial_slice_resumes_where_it_stopped_and_is_never_the_finished_file(source, tmp_path):
    target = tmp_path / slice_file_name(2, 3)
    stopped = fetch_locally(source, 2, 3, tmp_path, stop_after=2)
    assert not target.exists()  # only `finish` gives the final name
    with stopped.journal_path.open("ab") as journal:
        journal.write(RECORD.pack(0, 1)[:5])  # a record torn by the kill
    layout = stopped.layout
    resumed = PartialSlice(target, layout)
    done = resumed.bytes_done
    assert done == resumed.resumed_bytes == stopped.bytes_done
    assert 0 < done < layout.share
    first_missing = resumed.missing()[0]
    assert first_missing == (2, layout.tensors[2].n_bytes // 2)  # from the middle of the third tensor
    resumed.close()
    finished = fetch_locally(source, 2, 3, tmp_path).finish()  # fetches only what is missing
    verify_slice(finished, source.fingerprint, 2, 3)
    assert not stopped.journal_path.exists() and not stopped.path.exists()


def test_a_corrupt_tensor_is_refused_and_fetched_again(source, tmp_path):
    layout = plan_slice(source.header, source.size, source.fingerprint, source.digests, 1, 2)
    partial = PartialSlice(tmp_path / slice_file_name(1, 2), layout)
    tensor = layout.tensors[0]
    with pytest.raises(SliceIntegrityError, match=f"tensor {tensor.name} arrived corrupt"):
        partial.write(0, 0, bytes(tensor.n_bytes))
    assert partial.missing()[0] == (0, 0)  # nothing of it is kept
    partial.close()
    assert PartialSlice(tmp_path / slice_file_name(1, 2), layout).missing()[0] == (0, 0)


def test_digests_are_computed_once_and_cached_next_to_the_file(source, tmp_path, monkeypatch):
    cached = source.path.with_name(source.path.name + DIGESTS_SUFFIX)
    assert json.loads(cached.read_text())["digests"] == [d.hex() for d in source.digests]
    lied = json.loads(cached.read_text())
    lied["digests"][0] = "00" * 32
    cached.write_text(json.dumps(lied))
    assert SourceModel.open(source.path).digests[0] == bytes(32)  # read from the cache, not recomputed
    os.utime(source.path)  # a changed file: its digests are computed again
    assert SourceModel.open(source.path).digests == source.digests
    with pytest.raises(ValueError, match="not the planned one"):
        plan_slice(source.header, source.size + 1, source.fingerprint, source.digests, 0, 1)
