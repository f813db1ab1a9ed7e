"""[Note: checkpoint reads] A checkpoint's files are hashed and read through an I/O engine
(offload/checkpoint/files.py): the digests are sha256's of every byte whatever the sizes,
stages and threads; PieceReader gives the bytes of any range, aligned or not; a load checks
every file before it changes any state, and names the first corrupted file in name order."""
import hashlib
import os
import warnings

import pytest
import torch

import offload
from offload.checkpoint import files as checkpoint_files
from offload.checkpoint.format import PieceReader
from offload.errors import CheckpointError
from offload.io import IOEngine

from support import batches, nvme_gpt_engine, train_offload


def write_random(path, size, seed):
    data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    with open(path, "wb") as f:
        f.write(data.numpy().tobytes())
    return data


@pytest.mark.parametrize("directory", ["disk", "tmpfs"])
def test_file_digests_are_the_sha256_of_every_byte(directory, tmp_path, monkeypatch):
    # stages of 8 KiB, two in flight: files of several stages wrap the ring, and sizes off
    # the page end in a partial read; more files than threads, in an order not by size
    monkeypatch.setattr(checkpoint_files, "DIGEST_STAGE_BYTES", 8192)
    monkeypatch.setattr(checkpoint_files, "DIGEST_STAGES", 2)
    if directory == "tmpfs":
        if not os.path.isdir("/dev/shm"):
            pytest.skip("no /dev/shm")
        root = os.path.join("/dev/shm", f"offload-test-digests-{os.getpid()}")
        os.makedirs(root)
    else:
        root = str(tmp_path)
    sizes = [5 * 8192 + 123, 0, 1, 4095, 4096, 8192, 3 * 8192, 70001]
    try:
        paths = [os.path.join(root, f"{i}.bin") for i in range(len(sizes))]
        for i, (path, size) in enumerate(zip(paths, sizes)):
            write_random(path, size, i)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no warning about a buffered fallback on tmpfs
            digests = checkpoint_files.file_digests(list(zip(paths, sizes)))
        expected = [hashlib.sha256(open(p, "rb").read()).hexdigest() for p in paths]
        assert digests == expected
    finally:
        if directory == "tmpfs":
            for name in os.listdir(root):
                os.unlink(os.path.join(root, name))
            os.rmdir(root)


def test_a_digest_read_error_comes_out_as_an_oserror(tmp_path):
    path = str(tmp_path / "short.bin")
    write_random(path, 10000, 0)
    with pytest.raises(OSError):  # the manifest's size is larger than the file: end of file
        checkpoint_files.file_digests([(path, 20000)])


def test_piece_reader_gives_the_bytes_of_any_range(tmp_path):
    data = write_random(str(tmp_path / "f.bin"), 3 * 4096 + 1000, 1)
    reader = PieceReader(str(tmp_path), {"f.bin": {"bytes": data.numel()}})
    try:
        for offset, nbytes in [(0, 4096), (4096, 2 * 4096), (0, data.numel()), (5, 4096), (4096, 100),
                               (3 * 4096, 1000), (data.numel() - 1, 1), (17, data.numel() - 17)]:
            out = torch.empty(nbytes, dtype=torch.uint8)
            reader.read("f.bin", offset, out)
            assert torch.equal(out, data[offset:offset + nbytes]), (offset, nbytes)
        # into a tensor that does not start on a page, in another dtype
        holder = torch.empty(1 + 2048, dtype=torch.float32)
        reader.read("f.bin", 4096, holder[1:])
        assert torch.equal(holder[1:].view(torch.uint8), data[4096:4096 + 8192])
        with pytest.raises(CheckpointError, match=r"f.bin.*outside the file"):
            reader.read("f.bin", data.numel() - 10, torch.empty(11, dtype=torch.uint8))
    finally:
        reader.close()


def test_a_load_names_the_first_corrupted_file_and_changes_nothing(tmp_path):
    _, engine = nvme_gpt_engine(tmp_path)
    with engine:
        train_offload(engine, batches(2))
        engine.save_checkpoint(str(tmp_path / "ckpt"))
        train_offload(engine, batches(1, seed=5))
        before = engine.state_dict()
        for name in ("unit-00003.bin", "unit-00001.bin"):  # two corrupted: the first by name is named
            path = str(tmp_path / "ckpt" / name)
            with open(path, "r+b") as f:
                f.seek(os.path.getsize(path) - 1)
                last = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([last[0] ^ 1]))
        with pytest.raises(CheckpointError, match=r"unit-00001\.bin.*sha256"):
            engine.load_checkpoint(str(tmp_path / "ckpt"))
        after = engine.state_dict()
        for k in before:
            assert torch.equal(before[k], after[k]), k


def test_an_io_engine_warns_about_a_buffered_fallback_unless_told_not_to():
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    path = os.path.join("/dev/shm", f"offload-test-warn-{os.getpid()}.bin")
    write_random(path, 8192, 0)
    try:
        for warn in (True, False):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with IOEngine("threads", warn_buffered=warn) as io:
                    io.read_into(torch.empty(8192, dtype=torch.uint8), path).wait()
            assert any("O_DIRECT" in str(w.message) for w in caught) is warn
    finally:
        os.unlink(path)


def test_checkpoint_files_are_read_by_the_engine_not_the_page_cache_reader(tmp_path, monkeypatch):
    """A load's reads of unit files go through PieceReader's engine (counted here), and a
    resumed run goes on as the saver's."""
    reads = []
    real = checkpoint_files.reading_engine

    def counting():
        io = real()
        read_into = io.read_into

        def counted(tensor, path, offset=0):
            reads.append((os.path.basename(path), tensor.numel()))
            return read_into(tensor, path, offset)
        io.read_into = counted
        return io
    monkeypatch.setattr(checkpoint_files, "reading_engine", counting)
    monkeypatch.setattr(offload.checkpoint.format, "reading_engine", counting)
    _, engine = nvme_gpt_engine(tmp_path)
    _, other = nvme_gpt_engine(tmp_path, "other")
    with engine, other:
        train_offload(engine, batches(2))
        engine.save_checkpoint(str(tmp_path / "ckpt"))
        other.load_checkpoint(str(tmp_path / "ckpt"))
        unit_bytes = sum(os.path.getsize(tmp_path / "ckpt" / n) for n in os.listdir(tmp_path / "ckpt")
                         if n.startswith("unit-"))
        read_bytes = sum(n for name, n in reads if name.startswith("unit-"))
        assert read_bytes >= 2 * unit_bytes  # every byte hashed, then every state read
        data = batches(2, seed=7)
        train_offload(engine, data)
        train_offload(other, data)
        a, b = engine.state_dict(), other.state_dict()
        for k in a:
            assert torch.equal(a[k], b[k]), k
