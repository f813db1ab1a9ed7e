"""The asynchronous I/O engine: round trips on every backend, error reporting, fallback.
Which backend "auto" picks is tests/test_io_probe.py."""
import gc
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import offload
import offload.io
from offload import _native
from offload.io import IOEngine, aligned_empty, probe_directory

from support import working_io_backends

COMPILED_BACKENDS = list(_native.io_available_backends())
BACKENDS = working_io_backends()
SIZES = [1, 7, 4095, 4096, 4097, 12345, 1 << 20, (3 << 20) + 5, (64 << 20) + 1]


def random_bytes(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


@pytest.fixture(params=BACKENDS)
def engine(request):
    with IOEngine(request.param, block_bytes=1 << 20, queue_depth=8) as io:
        yield io


def test_backends_compiled_and_probed(tmp_path):
    assert set(COMPILED_BACKENDS) >= {"io_uring", "libaio", "threads"}
    assert "threads" in BACKENDS
    report = probe_directory(tmp_path)
    assert report["o_direct"] is True
    assert all(r["ok"] for r in report["backends"].values())
    first_working = next(b for b in offload.io.BACKENDS if b in BACKENDS)
    assert report["choice"] == report["best"] == first_working
    with IOEngine("auto", probe_dir=str(tmp_path)) as io:
        assert io.backend == report["choice"]


@pytest.mark.parametrize("nbytes", SIZES)
def test_round_trip_aligned_and_unaligned_sizes(engine, tmp_path, nbytes):
    path = tmp_path / "x.bin"
    for offset, make in ((0, aligned_empty), (8192, aligned_empty),
                         (5, lambda n: torch.empty(n, dtype=torch.uint8))):
        data = make(nbytes)
        data.copy_(random_bytes(nbytes, seed=nbytes))
        back = make(nbytes)
        assert engine.write_from(data, path, offset).wait() == nbytes
        assert engine.read_into(back, str(path), offset=offset).wait() == nbytes
        assert torch.equal(data, back)
        os.unlink(path)


def test_unaligned_write_keeps_neighbours_and_file_size(engine, tmp_path):
    path = tmp_path / "x.bin"
    base = random_bytes(3 * 4096, seed=1)
    engine.write_from(base, path, 0).wait()
    patch = random_bytes(10, seed=2)
    engine.write_from(patch, path, 4090).wait()  # straddles a block boundary
    expected = base.clone()
    expected[4090:4100] = patch
    back = torch.empty_like(base)
    engine.read_into(back, path, 0).wait()
    assert torch.equal(back, expected)
    assert os.path.getsize(path) == 3 * 4096
    engine.write_from(patch, path, 3 * 4096 + 1).wait()  # past the end: grows exactly
    assert os.path.getsize(path) == 3 * 4096 + 11


def test_many_requests_in_flight_interleaved_on_one_file(engine, tmp_path):
    path = tmp_path / "x.bin"
    chunk = 256 << 10
    chunks = [random_bytes(chunk, seed=i) for i in range(32)]
    sources = [aligned_empty(chunk) for _ in chunks]
    for src, c in zip(sources, chunks):
        src.copy_(c)
    handles = [engine.write_from(s, path, i * chunk) for i, s in enumerate(sources[:16])]
    for h in handles:
        h.wait()
    # Reads of the first half interleaved with writes of the second half.
    backs = [aligned_empty(chunk) for _ in range(16)]
    handles = []
    for i in range(16):
        handles.append(engine.read_into(backs[i], path, i * chunk))
        handles.append(engine.write_from(sources[16 + i], path, (16 + i) * chunk))
    engine.wait_all()
    assert all(h.done() for h in handles)
    for i in range(16):
        assert torch.equal(backs[i], chunks[i])
    whole = aligned_empty(32 * chunk)
    engine.read_into(whole, path, 0).wait()
    assert torch.equal(whole, torch.cat(chunks))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int64])
def test_non_uint8_dtypes_move_as_bytes(engine, tmp_path, dtype):
    src = aligned_empty(1 << 20, dtype=dtype)
    src.copy_(torch.randn(src.numel()).to(dtype))
    back = torch.zeros(777, dtype=dtype)  # plain allocation, odd length: bounced
    engine.write_from(src, tmp_path / "x.bin", 0).wait()
    engine.read_into(back, tmp_path / "x.bin", 4096).wait()
    assert torch.equal(back, src[4096 // src.element_size():][:777])


def test_read_past_end_names_file_and_engine_stays_usable(engine, tmp_path):
    path = tmp_path / "short.bin"
    engine.write_from(aligned_empty(8192).fill_(3), path, 0).wait()
    good = [aligned_empty(4096) for _ in range(4)]
    handles = [engine.read_into(g, path, 0) for g in good[:2]]
    bad = engine.read_into(aligned_empty(1 << 20), path, 0)
    handles += [engine.read_into(g, path, 4096) for g in good[2:]]
    with pytest.raises(OSError) as info:
        bad.wait()
    assert str(path) in str(info.value) and "offset" in str(info.value)
    assert info.value.errno is not None
    assert [h.wait() for h in handles] == [4096] * 4
    with pytest.raises(OSError, match="short.bin"):
        engine.read_into(torch.empty(10, dtype=torch.uint8), path, 8190).wait()
    with pytest.raises(OSError):  # wait_all reports a failure not yet seen
        engine.read_into(aligned_empty(4096), path, 1 << 20)
        engine.wait_all()
    back = aligned_empty(8192)
    assert engine.read_into(back, path, 0).wait() == 8192 and bool((back == 3).all())


def test_missing_file_and_file_as_directory_are_named_errors(engine, tmp_path):
    path = tmp_path / "gone.bin"
    engine.write_from(aligned_empty(4096), path, 0).wait()
    os.unlink(path)
    with pytest.raises(FileNotFoundError, match="gone.bin") as info:
        engine.read_into(aligned_empty(4096), path, 0).wait()
    assert "open" in str(info.value)
    not_a_dir = tmp_path / "plain-file"
    not_a_dir.write_bytes(b"x")
    with pytest.raises(NotADirectoryError, match="plain-file"):
        engine.write_from(aligned_empty(4096), not_a_dir / "x.bin", 0).wait()
    assert engine.write_from(aligned_empty(4096), tmp_path / "ok.bin", 0).wait() == 4096


@pytest.mark.parametrize("backend", BACKENDS)
def test_full_filesystem_is_a_named_error(tmp_path, backend):
    # RLIMIT_FSIZE makes the kernel refuse writes past 1 MiB with EFBIG, like a full disk.
    script = textwrap.dedent(f"""
        import errno, resource, signal, torch
        from offload.io import IOEngine, aligned_empty
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        with IOEngine({backend!r}, block_bytes=256 << 10, queue_depth=4) as io:
            try:
                io.write_from(aligned_empty(4 << 20), {str(tmp_path / 'big.bin')!r}, 0).wait()
                print("no error")
            except OSError as e:
                print("errno", errno.errorcode[e.errno], "|", e)
            small = aligned_empty(4096).fill_(9)
            io.write_from(small, {str(tmp_path / 'small.bin')!r}, 0).wait()
            print("usable", io.read_into(aligned_empty(4096), {str(tmp_path / 'small.bin')!r}, 0).wait())
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.returncode == 0, out.stderr
    assert "errno EFBIG" in out.stdout or "errno ENOSPC" in out.stdout, out.stdout
    assert "big.bin" in out.stdout and "offset" in out.stdout
    assert "usable 4096" in out.stdout


def test_tmpfs_falls_back_to_buffered_with_one_warning(tmp_path):
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    directory = os.path.join("/dev/shm", f"offload-test-{os.getpid()}")
    os.makedirs(directory, exist_ok=True)
    try:
        assert probe_directory(directory)["o_direct"] is False
        with IOEngine("auto") as io:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for i in range(3):
                    data = random_bytes(12345 + i, seed=i)
                    io.write_from(data, os.path.join(directory, f"{i}.bin"), 1).wait()
                    back = torch.empty_like(data)
                    io.read_into(back, os.path.join(directory, f"{i}.bin"), 1).wait()
                    assert torch.equal(back, data)
            messages = [str(w.message) for w in caught if "O_DIRECT" in str(w.message)]
            assert len(messages) == 1, messages
    finally:
        for name in os.listdir(directory):
            os.unlink(os.path.join(directory, name))
        os.rmdir(directory)


def test_bad_arguments_name_the_argument(tmp_path):
    with pytest.raises(ValueError, match="backend"):
        IOEngine("nope")
    with pytest.raises(ValueError, match="block_bytes"):
        IOEngine("threads", block_bytes=1000)
    with pytest.raises(ValueError, match="queue_depth"):
        IOEngine("threads", queue_depth=0)
    with pytest.raises(TypeError, match="queue_depth"):
        IOEngine("threads", queue_depth=2.0)
    with pytest.raises(TypeError, match="warn_buffered"):
        IOEngine("threads", warn_buffered="no")
    with IOEngine("threads") as io:
        with pytest.raises(ValueError, match="contiguous"):
            io.write_from(torch.zeros(4, 4).t(), tmp_path / "x", 0)
        with pytest.raises(ValueError, match="offset"):
            io.write_from(torch.zeros(4), tmp_path / "x", -1)
        with pytest.raises(TypeError, match="tensor"):
            io.write_from(b"abc", tmp_path / "x", 0)
    with pytest.raises(ValueError, match="closed"):
        io.write_from(torch.zeros(4), tmp_path / "x", 0)


def test_aligned_empty():
    for n in (0, 1, 4096, 12345):
        t = aligned_empty(n)
        assert t.numel() == n and t.dtype == torch.uint8 and t.data_ptr() % 4096 == 0
    f = aligned_empty(4096, dtype=torch.float32)
    assert f.numel() == 1024 and f.data_ptr() % 4096 == 0
    with pytest.raises(ValueError, match="nbytes"):
        aligned_empty(6, dtype=torch.float32)


def _vm_flags_of(address):
    """VmFlags of the mapping holding ``address``, from /proc/self/smaps."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(x, 16) for x in head.split("-"))
                inside = low <= address < high
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    return None


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA buffers come pinned")
def test_large_buffers_ask_for_huge_pages_and_are_freed():
    if not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"):
        pytest.skip("kernel without transparent huge pages")
    nbytes = (6 << 20) + 12345  # whole huge pages plus a 4 KiB-page tail
    buf = aligned_empty(nbytes)
    address = buf.data_ptr()
    assert address % (2 << 20) == 0 and buf.numel() == nbytes
    assert "hg" in _vm_flags_of(address)  # MADV_HUGEPAGE
    assert "hg" not in _vm_flags_of(address + (6 << 20))  # the tail is not rounded up
    buf.copy_(random_bytes(nbytes, seed=3))
    view = buf[4096:8192].clone()
    assert torch.equal(view, random_bytes(nbytes, seed=3)[4096:8192])
    del buf
    gc.collect()
    assert _vm_flags_of(address) is None or "hg" not in _vm_flags_of(address)  # unmapped


def test_thousands_of_small_requests_complete(engine, tmp_path):
    path = tmp_path / "small.bin"
    page = 4096
    data = aligned_empty(512 * page)
    data.copy_(random_bytes(512 * page, seed=5))
    pages = [data[i * page:(i + 1) * page] for i in range(512)]
    order = torch.randperm(512, generator=torch.Generator().manual_seed(0)).tolist()
    handles = [engine.write_from(pages[i], path, i * page) for i in order]
    assert sum(h.wait() for h in handles) == 512 * page
    back = aligned_empty(512 * page)
    handles = [engine.read_into(back[i * page:(i + 1) * page], path, i * page) for i in order]
    engine.wait_all()
    assert all(h.done() for h in handles)
    assert torch.equal(back, data)


def test_wait_releases_the_gil(tmp_path):
    import threading
    with IOEngine("threads", block_bytes=1 << 20, queue_depth=1) as io:
        buf = aligned_empty(32 << 20)
        ticks = []
        stop = threading.Event()

        def ticker():
            while not stop.is_set():
                ticks.append(1)
                stop.wait(0.001)

        thread = threading.Thread(target=ticker)
        thread.start()
        try:
            for _ in range(3):
                io.write_from(buf, tmp_path / "g.bin", 0).wait()
        finally:
            stop.set()
            thread.join()
        assert len(ticks) > 1


def _fds_open_on(directory):
    """Targets of this process's descriptors that lie in ``directory`` (removed files end in
    ' (deleted)')."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed since listdir
            continue
        if target.startswith(str(directory) + os.sep):
            found.append(target)
    return found


def test_handle_times_are_perf_counter_seconds_of_issue_and_finish(engine, tmp_path):
    """IOHandle.times(): (first block issued, finished) on time.perf_counter's clock (the
    engine's trace lines them up with Python's spans)."""
    import time

    path = tmp_path / "f"
    buf = aligned_empty(4 << 20)
    buf.fill_(3)
    before = time.perf_counter()
    handle = engine.write_from(buf, path)
    handle.wait()
    after = time.perf_counter()
    started, finished = handle.times()
    assert before <= started <= finished <= after
    missing = engine.read_into(aligned_empty(4096), tmp_path / "missing")
    with pytest.raises(OSError):
        missing.wait()
    started, finished = missing.times()  # failed at open: no block was issued
    assert started == finished and before <= started <= time.perf_counter()


def test_file_stays_open_between_requests(engine, tmp_path):
    path = tmp_path / "kept.bin"
    data = aligned_empty(64 << 10)
    data.copy_(random_bytes(64 << 10, seed=11))
    for i in range(8):
        engine.write_from(data[i * 8192:(i + 1) * 8192], path, i * 8192).wait()
    back = aligned_empty(64 << 10)
    for i in range(8):
        engine.read_into(back[i * 8192:(i + 1) * 8192], path, i * 8192).wait()
    assert torch.equal(back, data)
    assert engine.num_open_files == 1
    assert _fds_open_on(tmp_path) == [str(path)]


def test_replaced_file_is_opened_anew(engine, tmp_path):
    path = tmp_path / "x.bin"
    engine.write_from(aligned_empty(4096).fill_(1), path, 0).wait()
    replacement = tmp_path / "new.bin"
    replacement.write_bytes(bytes([2]) * 4096)
    os.replace(replacement, path)
    back = aligned_empty(4096)
    engine.read_into(back, path, 0).wait()
    assert bool((back == 2).all())
    engine.write_from(aligned_empty(4096).fill_(3), path, 0).wait()
    assert path.read_bytes() == bytes([3]) * 4096  # written to the file now at the path


def test_write_after_remove_creates_the_file_again(engine, tmp_path):
    path = tmp_path / "x.bin"
    engine.write_from(aligned_empty(4096).fill_(1), path, 0).wait()
    os.unlink(path)
    engine.write_from(aligned_empty(4096).fill_(4), path, 0).wait()
    assert path.read_bytes() == bytes([4]) * 4096
    assert not [t for t in _fds_open_on(tmp_path) if t.endswith("(deleted)")]


def test_file_opened_for_reading_is_reopened_for_writing(engine, tmp_path):
    path = tmp_path / "x.bin"
    path.write_bytes(bytes([5]) * 8192)
    back = aligned_empty(8192)
    engine.read_into(back, path, 0).wait()
    assert bool((back == 5).all())
    engine.write_from(aligned_empty(4096).fill_(6), path, 4096).wait()
    engine.read_into(back, path, 0).wait()
    assert bool((back[:4096] == 5).all()) and bool((back[4096:] == 6).all())
    assert engine.num_open_files == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_many_files_keep_at_most_max_open_files_open(tmp_path, backend):
    num_files, limit = 40, 4
    sources = [aligned_empty(8192) for _ in range(num_files)]
    for i, src in enumerate(sources):
        src.copy_(random_bytes(8192, seed=100 + i))
    with IOEngine(backend, queue_depth=8, max_open_files=limit) as io:
        # All in flight at once: a file evicted from the cache stays open for its request.
        handles = [io.write_from(s, tmp_path / f"{i}.bin", 0) for i, s in enumerate(sources)]
        assert [h.wait() for h in handles] == [8192] * num_files
        backs = [aligned_empty(8192) for _ in range(num_files)]
        for round_ in range(2):
            handles = [io.read_into(b, tmp_path / f"{i}.bin", 0) for i, b in enumerate(backs)]
            io.wait_all()
            assert all(torch.equal(b, s) for b, s in zip(backs, sources))
        assert io.num_open_files == limit
        assert len(_fds_open_on(tmp_path)) == limit
    assert _fds_open_on(tmp_path) == []  # close() lets go of every file


def test_close_files_frees_removed_files(engine, tmp_path):
    path = tmp_path / "x.bin"
    engine.write_from(aligned_empty(1 << 20), path, 0).wait()
    os.unlink(path)
    assert _fds_open_on(tmp_path) == [f"{path} (deleted)"]  # space still held
    engine.close_files()
    assert engine.num_open_files == 0 and _fds_open_on(tmp_path) == []
    with pytest.raises(FileNotFoundError, match="x.bin"):
        engine.read_into(aligned_empty(4096), path, 0).wait()


def test_no_file_cache_when_max_open_files_is_zero(tmp_path):
    with IOEngine("threads", max_open_files=0) as io:
        data = aligned_empty(8192).fill_(7)
        io.write_from(data, tmp_path / "x.bin", 0).wait()
        back = aligned_empty(8192)
        io.read_into(back, tmp_path / "x.bin", 0).wait()
        assert torch.equal(back, data)
        assert io.num_open_files == 0 and _fds_open_on(tmp_path) == []
    with pytest.raises(ValueError, match="max_open_files"):
        IOEngine("threads", max_open_files=-1)
