"""The safetensors file format, read and written a tensor at a time, without the
``safetensors`` package: weights in (``wrap(..., weights=PATH)``) and out
(``Engine.save_pretrained``) in the format Hugging Face ships models in.

A file is an 8-byte little-endian header length N, N bytes of JSON (for each tensor its
``dtype``, ``shape`` and ``data_offsets`` [begin, end) into the data that follows; an
optional ``__metadata__`` of strings), then the tensors' bytes, C order, little-endian. A
sharded model has ``model.safetensors.index.json``: ``{"metadata": {...}, "weight_map":
{name: file}}``.

Reads go through ``pread`` into a buffer of that one tensor (no memory map): the page cache
may keep the file, the process does not, so loading a model bigger than RAM holds one
tensor at a time. Every file is checked when it is opened: a regular file (a FIFO, a device
or a directory is refused without being read, so it cannot block the load), and a header of
known dtypes whose tensors lie inside the data and overlap no other; a bad one is a
ValueError naming the file and the tensor.

[Note: save ids] A writer of a model directory may give it a save id (SAVE_ID_KEY): in each
file's ``__metadata__`` and in the index's ``metadata``. A reader of that directory refuses
a file whose id differs from the index's (or, without an id in the index, from the other
files'), naming it: a directory holding files of two saves, however it came to, is refused
rather than loaded as a mix. Files without an id (other tools write none) load as before.
"""
from __future__ import annotations

import json
import math
import os
import secrets
import stat
from typing import Any, BinaryIO, Callable, Dict, Iterable, List, Optional, Tuple, Union

import torch

from offload.errors import warn_at_caller

__all__ = ["SafetensorsFile", "SafetensorsWriter", "WeightFiles", "DTYPES", "INDEX_NAME", "SINGLE_NAME",
           "SAVE_ID_KEY", "open_regular"]

SINGLE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
SAVE_ID_KEY = "offload_save_id"  # [Note: save ids]
_MAX_HEADER_BYTES = 100 << 20  # the reference implementation's limit

DTYPES: Dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_NAME_OF = {dtype: name for name, dtype in DTYPES.items()}
_FP8_BITS = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}  # explicit mantissa bits


def _kind(mode: int) -> str:
    return ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else
            "a socket" if stat.S_ISSOCK(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "not a regular file")


def open_regular(path: str) -> int:
    """A read-only descriptor of the regular file ``path`` (a symbolic link is followed, as
    in a Hugging Face cache snapshot). Anything else is a ValueError naming it: checked with
    stat before the open, so a FIFO or a device is never opened, and again on the descriptor
    (opened O_NONBLOCK, which cannot block) in case ``path`` was replaced in between."""
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            raise ValueError(f"weights: {path!r} is {_kind(mode)}, not a regular file")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        raise ValueError(f"weights: cannot open {path!r}: {error.strerror}") from error
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise ValueError(f"weights: {path!r} is {_kind(mode)}, not a regular file")
    return fd


class SafetensorsFile:
    """One .safetensors file: its checked header, and ``read(name)`` of one tensor."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = open_regular(path)
        try:
            self.entries, self.metadata, self._data_start = self._read_header()
        except BaseException:
            os.close(self._fd)
            raise

    def _bad(self, why: str) -> ValueError:
        return ValueError(f"weights: {self.path!r} is not a valid safetensors file: {why}")

    def _read_header(self) -> Tuple[Dict[str, Tuple[torch.dtype, Tuple[int, ...], int, int]], Dict[str, str], int]:
        size = os.fstat(self._fd).st_size
        head = os.pread(self._fd, 8, 0)
        if len(head) < 8:
            raise self._bad("shorter than its 8-byte header length")
        n = int.from_bytes(head, "little")
        if n > _MAX_HEADER_BYTES or 8 + n > size:
            raise self._bad(f"header length {n} does not fit the file ({size} bytes)")
        try:
            header = json.loads(os.pread(self._fd, n, 8).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise self._bad(f"its header is not JSON ({error})") from None
        if not isinstance(header, dict):
            raise self._bad("its header is not a JSON object")
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise self._bad("__metadata__ must map strings to strings")
        data_bytes = size - 8 - n
        entries = {}
        for name, info in header.items():
            try:
                dtype = DTYPES[info["dtype"]]
                shape = tuple(info["shape"])
                begin, end = info["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise self._bad(f"tensor {name!r} needs a known dtype ({sorted(DTYPES)}), a shape "
                                f"and data_offsets, got {info!r}") from None
            if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape) or \
                    not all(isinstance(o, int) and not isinstance(o, bool) for o in (begin, end)):
                raise self._bad(f"tensor {name!r}: shape and data_offsets must be non-negative ints")
            nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
            if not 0 <= begin <= end <= data_bytes or end - begin != nbytes:
                raise self._bad(f"tensor {name!r}: data_offsets [{begin}, {end}) do not hold {shape} "
                                f"{info['dtype']} ({nbytes} bytes) inside the {data_bytes} data bytes")
            entries[name] = (dtype, shape, begin, end)
        by_start = sorted((begin, end, name) for name, (_, _, begin, end) in entries.items() if end > begin)
        for (_, end, name), (begin, _, other) in zip(by_start, by_start[1:]):
            if begin < end:
                raise self._bad(f"tensors {name!r} and {other!r} overlap (their data_offsets share "
                                f"bytes [{begin}, {end}))")
        return entries, metadata, 8 + n

    def read(self, name: str) -> torch.Tensor:
        """Tensor ``name``, in a buffer of its own (the file is not kept mapped)."""
        dtype, shape, begin, end = self.entries[name]
        out = torch.empty(shape, dtype=dtype)
        view = memoryview(out.view(torch.uint8).reshape(-1).numpy()) if out.numel() else memoryview(b"")
        done = 0
        while done < end - begin:
            try:
                got = os.preadv(self._fd, [view[done:]], self._data_start + begin + done)
            except OSError as error:
                raise OSError(error.errno, f"weights: could not read tensor {name!r} ({error.strerror})",
                              self.path) from error
            if got <= 0:
                raise OSError(f"weights: {self.path!r} ended inside tensor {name!r}")
            done += got
        return out

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class WeightFiles:
    """The weights of one model: a Hugging Face model directory (``model.safetensors``, or
    ``model.safetensors.index.json`` and its shards; ``model.safetensors`` when both are
    there, as ``from_pretrained`` chooses) or a single ``.safetensors`` file. Local paths
    only; nothing is downloaded. ``shapes`` maps every tensor name to (dtype, shape). A
    directory whose files carry different save ids is refused ([Note: save ids])."""

    def __init__(self, path: "str | os.PathLike[str]") -> None:
        path = os.fspath(path)
        self.path = path
        index_path, index_id = None, None
        if os.path.isdir(path):
            single, index = os.path.join(path, SINGLE_NAME), os.path.join(path, INDEX_NAME)
            if os.path.isfile(single) or (os.path.lexists(single) and not os.path.isfile(index)):
                files = [single]  # a non-regular one is refused by name when it is opened
            elif os.path.lexists(index):
                index_path = index
                names, index_id = self._shards_of(index)
                files = [os.path.join(path, name) for name in names]
            else:
                raise ValueError(f"weights: {path!r} holds neither {SINGLE_NAME} nor {INDEX_NAME} (only "
                                 "safetensors weights are read; nothing is downloaded)")
        elif os.path.isfile(path) and path.endswith(".safetensors"):
            files = [path]
        else:
            raise ValueError(f"weights: {path!r} is neither a model directory nor a .safetensors file "
                             "(local paths only; nothing is downloaded)")
        self._files: List[SafetensorsFile] = []
        self._file_of: Dict[str, SafetensorsFile] = {}
        try:
            for f in files:
                st = SafetensorsFile(f)
                self._files.append(st)
                for name in st.entries:
                    if name in self._file_of:
                        raise ValueError(f"weights: tensor {name!r} is in both {self._file_of[name].path!r} "
                                         f"and {f!r}")
                    self._file_of[name] = st
            self._check_save_ids(index_path, index_id)
        except BaseException:
            self.close()
            raise
        self.shapes: Dict[str, Tuple[torch.dtype, Tuple[int, ...]]] = {
            name: st.entries[name][:2] for name, st in self._file_of.items()}

    @staticmethod
    def _shards_of(index: str) -> Tuple[Dict[str, None], Optional[str]]:
        """The shards the index names, and its save id (None without one)."""
        fd = open_regular(index)
        try:
            with os.fdopen(fd, encoding="utf-8") as f:
                content = json.load(f)
            shards = dict.fromkeys(content["weight_map"].values())
            metadata = content.get("metadata") or {}
            save_id = metadata.get(SAVE_ID_KEY) if isinstance(metadata, dict) else None
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"weights: {index!r} is not a safetensors index with a weight_map ({error})") from None
        for shard in shards:
            if not isinstance(shard, str) or os.path.basename(shard) != shard or shard in ("", ".", ".."):
                raise ValueError(f"weights: {index!r} names shard {shard!r}, not a file beside it")
        if save_id is not None and not isinstance(save_id, str):
            raise ValueError(f"weights: {index!r}: metadata.{SAVE_ID_KEY} must be a string, got {save_id!r}")
        return shards, save_id

    def _check_save_ids(self, index: Optional[str], index_id: Optional[str]) -> None:
        """[Note: save ids] Every file with an id has the index's, or the first file's."""
        reference, expected = index, index_id
        for st in self._files:
            got = st.metadata.get(SAVE_ID_KEY)
            if got is None:
                continue
            if expected is None:
                reference, expected = st.path, got
            elif got != expected:
                raise ValueError(
                    f"weights: {st.path!r} is from another save than {reference!r} (save id {got!r}, not "
                    f"{expected!r}): the directory mixes files of two saves, as an interrupted or concurrent "
                    "writer leaves it; save the weights again, or load a directory written in one piece")

    def check_conversion(self, name: str, dtype: torch.dtype, what: str = "parameter") -> None:
        """Whether tensor ``name`` may become a ``dtype`` ``what``: integers or bools into a
        floating-point one are a ValueError (their values are indices or flags, not weights:
        the wrong file or the wrong name); fp8 into a wider floating-point one loads with a
        warning giving the precision it keeps. Anything else converts silently."""
        have = self.shapes[name][0]
        path = self._file_of[name].path
        if dtype.is_floating_point and not have.is_floating_point:
            raise ValueError(f"weights: tensor {name!r} of {path!r} is {have}, and the {what} it would "
                             f"load into is {dtype}: integer or bool values are not weights")
        if have in _FP8_BITS and dtype.is_floating_point and dtype.itemsize > have.itemsize:
            warn_at_caller(f"weights: tensor {name!r} of {path!r} is {have} and loads into a {dtype} {what}: "
                           f"its values keep fp8 precision ({_FP8_BITS[have]} mantissa bits), and any "
                           "per-tensor scale the file's quantization used is not applied", UserWarning)

    def read(self, name: str) -> torch.Tensor:
        return self._file_of[name].read(name)

    def close(self) -> None:
        for f in self._files:
            f.close()

    def __enter__(self) -> "WeightFiles":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SafetensorsWriter:
    """Writes one .safetensors file whose tensors are known up front (``layout``: name,
    dtype, shape, in file order) and whose values come a tensor at a time through
    ``write(name, tensor)``, in that order.

    ``out`` is a path or a binary file. A path: the file appears there only on ``finish()``,
    written first as a new file ``PATH.partial-PID-HEX`` beside it (created O_EXCL|O_NOFOLLOW,
    so nothing planted at that name is written through; mode 0600), fsynced, then renamed;
    an OSError keeps its errno and names the file. A binary file open for writing at its
    start: the caller made it and syncs and closes it; ``finish()`` checks that every tensor
    was written."""

    def __init__(self, out: "Union[str, os.PathLike[str], BinaryIO]",
                 layout: Iterable[Tuple[str, torch.dtype, Tuple[int, ...]]],
                 metadata: Optional[Dict[str, str]] = None) -> None:
        header: Dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
        self._order: List[Tuple[str, torch.dtype, Tuple[int, ...], int]] = []
        offset = 0
        for name, dtype, shape in layout:
            nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
            header[name] = {"dtype": _NAME_OF[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self._order.append((name, dtype, tuple(shape), nbytes))
            offset += nbytes
        self.data_bytes = offset
        text = json.dumps(header, separators=(",", ":")).encode("utf-8")
        text += b" " * (-len(text) % 8)
        self._next = 0
        self._partial: Optional[str] = None
        if isinstance(out, (str, os.PathLike)):
            self.path = os.fspath(out)
            self._partial = f"{self.path}.partial-{os.getpid()}-{secrets.token_hex(4)}"
            fd = self._checked("create", os.open, self._partial,
                               os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                self._checked("set the mode of", os.fchmod, fd, 0o600)
            except BaseException:
                os.close(fd)
                os.unlink(self._partial)
                raise
            self._file: BinaryIO = os.fdopen(fd, "wb")
        else:
            self.path = getattr(out, "name", repr(out))
            self._file = out
        try:
            self._checked("write", self._file.write, len(text).to_bytes(8, "little") + text)
        except BaseException:
            self.abandon()
            raise

    def _checked(self, what: str, call: Callable[..., Any], *args: Any) -> Any:
        """``call(*args)``; where this writer made the file, an OSError names it, errno kept
        (a given file's own errors name it already)."""
        if self._partial is None:
            return call(*args)
        try:
            return call(*args)
        except OSError as error:
            raise OSError(error.errno, f"safetensors writer could not {what} {os.path.basename(self.path)!r} "
                          f"({error.strerror or error})", self._partial) from error

    def write(self, name: str, tensor: torch.Tensor) -> None:
        want, dtype, shape, nbytes = self._order[self._next]
        if name != want or tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(f"safetensors writer: expected {want!r} {shape} {dtype}, got {name!r} "
                             f"{tuple(tensor.shape)} {tensor.dtype}")
        self.write_parts(name, [tensor])

    def write_parts(self, name: str, parts: Iterable[torch.Tensor]) -> None:
        """Tensor ``name`` as consecutive flat parts of its dtype (a big tensor streamed in
        chunks); their bytes must add up to the tensor's."""
        want, dtype, shape, nbytes = self._order[self._next]
        if name != want:
            raise ValueError(f"safetensors writer: expected {want!r}, got {name!r}")
        written = 0
        for part in parts:
            if part.dtype != dtype:
                raise ValueError(f"safetensors writer: {name!r} is {dtype}, got a part in {part.dtype}")
            data = part.detach().to("cpu").contiguous().reshape(-1)
            if data.numel():
                self._checked("write", self._file.write, memoryview(data.view(torch.uint8).numpy()))
            written += data.numel() * data.element_size()
        if written != nbytes:
            raise ValueError(f"safetensors writer: {name!r} needs {nbytes} bytes, got {written}")
        self._next += 1

    def finish(self) -> None:
        if self._next != len(self._order):
            raise ValueError(f"safetensors writer: {len(self._order) - self._next} tensors of {self.path!r} "
                             "were never written")
        self._checked("write", self._file.flush)
        if self._partial is None:
            return
        self._checked("fsync", os.fsync, self._file.fileno())
        self._checked("close", self._file.close)
        self._checked("rename into place", os.replace, self._partial, self.path)
        self._partial = None

    def abandon(self) -> None:
        """Stop; a file this writer made is removed (a given one is the caller's)."""
        if self._partial is None:
            return
        try:
            self._file.close()
        except OSError:
            pass  # the write that failed already raised; the file goes anyway
        try:
            os.unlink(self._partial)
        except FileNotFoundError:
            pass
        self._partial = None
