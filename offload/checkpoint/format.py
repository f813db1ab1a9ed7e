"""The checkpoint format, and reading a checkpoint back.

A checkpoint is a directory of raw little-endian files plus ``manifest.json``:

  manifest.json       format/version, the world size and ZeRO stage that wrote it, the config
                      of the run, engine counters (micro-step, loss scale), param-group
                      hyperparameters, each rank's Python/NumPy RNG states, per-parameter
                      entries (fqn, aliases, shape, dtype, Adam step count, and its *pieces*:
                      which file holds which elements, at which byte offsets), and every file
                      with its size and sha256. A ``checksum`` field covers the manifest.
  unit-NNNNN.bin      per unit (``unit-NNNNN-rank-RRRRR.bin`` per unit and rank when several
                      ranks wrote it): fp32 master of the elements written | exp_avg |
                      exp_avg_sq | the compute copy of frozen parameters (compute dtype).
                      Trainable compute copies are derived (fp32: the master itself;
                      bf16/fp16: the master rounded to nearest even, as the Adam kernel writes
                      them; bf16 with a split master: rounded half away from zero, see
                      [Note: split master] in native/adam/master_split.cpp), so they are not
                      stored.
  buffers.bin         the model's persistent buffers (byte offsets in the manifest).
  rng-torch-cpu.bin, rng-torch-cuda-N.bin   torch's RNG states (``-rank-RRRRR`` per rank).

Version 1 manifests (one process, one piece per parameter) are read too: read_manifest
converts them to the current layout. Nothing is unpickled on load.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Any, BinaryIO, Dict, List, Tuple

import torch
from torch import nn

from offload.errors import CheckpointError

FORMAT = "offload-checkpoint"
VERSION = 2
READABLE_VERSIONS = (1, 2)
MANIFEST = "manifest.json"
CHUNK_BYTES = 4 << 20
_FILE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
               torch.float64: "float64", torch.int64: "int64", torch.int32: "int32",
               torch.int16: "int16", torch.int8: "int8", torch.uint8: "uint8", torch.bool: "bool"}
DTYPES = {v: k for k, v in DTYPE_NAMES.items()}


# ---------------------------------------------------------------------- small helpers
def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"checkpoint: tensors of dtype {dtype} are not supported")
    return DTYPE_NAMES[dtype]


def as_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (little-endian machines)."""
    t = t.detach().contiguous()
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def manifest_checksum(manifest: Dict[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def state_dict_aliases(module: nn.Module) -> Tuple[Dict[nn.Parameter, List[str]], Dict[str, torch.Tensor]]:
    """Every state_dict key of each parameter (ties give several), and the buffers."""
    names: Dict[nn.Parameter, List[str]] = {}
    buffers: Dict[str, torch.Tensor] = {}
    for key, value in module.state_dict(keep_vars=True).items():
        if isinstance(value, nn.Parameter):
            names.setdefault(value, []).append(key)
        else:
            buffers[key] = value
    return names, buffers


def numel_of(shape: List[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# ---------------------------------------------------------------------- verify and read
def checked_path(ckpt_dir: str, file_name: Any) -> str:
    if not isinstance(file_name, str) or not _FILE_NAME_RE.match(file_name) or file_name == MANIFEST:
        raise CheckpointError(f"checkpoint {ckpt_dir!r}: the manifest names the file {file_name!r}, "
                              "which is not a plain file name inside the checkpoint directory")
    path = os.path.join(ckpt_dir, file_name)
    if os.path.islink(path):
        raise CheckpointError(f"checkpoint {ckpt_dir!r}: {file_name!r} is a symbolic link")
    return path


def read_manifest(ckpt_dir: str, share: Tuple[int, int] = (0, 1)) -> Dict[str, Any]:
    """The manifest after checking every file it lists (existence, size, sha256), in the
    current layout (a version 1 manifest is converted). ``share=(i, n)``: hash only every
    n-th file from the i-th (the ranks of a sharded load split the work)."""
    ckpt_dir = os.path.abspath(os.fspath(ckpt_dir))
    path = os.path.join(ckpt_dir, MANIFEST)
    if not os.path.isdir(ckpt_dir):
        raise CheckpointError(f"checkpoint {ckpt_dir!r} does not exist or is not a directory")
    try:
        with open(path) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {ckpt_dir!r}: {MANIFEST} is missing (an incomplete "
                              "or foreign directory)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"checkpoint {ckpt_dir!r}: {MANIFEST} is not valid JSON ({error})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {ckpt_dir!r}: {MANIFEST} is not an {FORMAT} manifest")
    if manifest.get("version") not in READABLE_VERSIONS:
        raise CheckpointError(f"checkpoint {ckpt_dir!r}: {MANIFEST} has version "
                              f"{manifest.get('version')!r}; this offload reads versions "
                              f"{', '.join(map(str, READABLE_VERSIONS))}")
    if manifest.get("checksum") != manifest_checksum(manifest):
        raise CheckpointError(f"checkpoint {ckpt_dir!r}: {MANIFEST} does not match its checksum "
                              "(the manifest was modified or corrupted)")
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise CheckpointError(f"checkpoint {ckpt_dir!r}: {MANIFEST} has no file list")
    buffer = bytearray(CHUNK_BYTES)
    view = memoryview(buffer)
    first, every = share
    for i, (file_name, info) in enumerate(sorted(files.items())):
        file_path = checked_path(ckpt_dir, file_name)
        try:
            size = os.stat(file_path).st_size
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint {ckpt_dir!r}: file {file_name!r} listed in the "
                                  "manifest is missing") from None
        if size != info.get("bytes"):
            raise CheckpointError(f"checkpoint {ckpt_dir!r}: file {file_name!r} has {size} bytes, "
                                  f"the manifest says {info.get('bytes')} (truncated or replaced)")
        if i % every != first:
            continue
        digest = hashlib.sha256()
        with open(file_path, "rb") as f:
            while True:
                n = f.readinto(buffer)
                if not n:
                    break
                digest.update(view[:n])
        if digest.hexdigest() != info.get("sha256"):
            raise CheckpointError(f"checkpoint {ckpt_dir!r}: file {file_name!r} does not match its "
                                  "sha256 checksum (corrupted)")
    if manifest["version"] == 1:
        _upgrade_version_1(manifest)
    _check_pieces(manifest, ckpt_dir)
    return manifest


def _upgrade_version_1(manifest: Dict[str, Any]) -> None:
    """Version 1 (one process): one file per unit, one offset per section and parameter."""
    for u in manifest["units"]:
        for r in u["entries"]:
            piece = {"file": u["file"], "start": 0, "numel": r["numel"]}
            if r["trainable"]:
                piece.update({key: r.pop(key) for key in ("master", "exp_avg", "exp_avg_sq")})
            else:
                piece.update(value=r.pop("value"), file_dtype=r["file_dtype"])
            r["pieces"] = [piece]
    manifest["rng"] = {"ranks": [manifest["rng"]]}
    manifest["world_size"] = 1
    manifest["stage"] = 0


def _check_pieces(manifest: Dict[str, Any], ckpt_dir: str) -> None:
    """Every parameter's pieces cover it once, in listed files, inside those files."""
    files = manifest["files"]
    keys = {True: ("master", "exp_avg", "exp_avg_sq"), False: ("value",)}
    for u in manifest["units"]:
        for r in u["entries"]:
            covered = 0
            for piece in r["pieces"]:
                file_name = piece.get("file")
                if file_name not in files:
                    checked_path(ckpt_dir, file_name)
                    raise CheckpointError(f"checkpoint {ckpt_dir!r}: parameter {r['fqn']!r} names the "
                                          f"file {file_name!r}, which the manifest does not list")
                if piece.get("start") != covered or not isinstance(piece.get("numel"), int) or piece["numel"] <= 0:
                    raise CheckpointError(f"checkpoint {ckpt_dir!r}: the pieces of parameter {r['fqn']!r} "
                                          "do not cover it exactly once")
                covered += piece["numel"]
                dtype = DTYPES.get("float32" if r["trainable"] else piece.get("file_dtype"))
                if dtype is None:
                    raise CheckpointError(f"checkpoint file {file_name!r}: parameter {r['fqn']!r} "
                                          f"has unknown dtype {piece.get('file_dtype')!r}")
                for key in keys[r["trainable"]]:
                    offset, nbytes, size = piece.get(key), piece["numel"] * dtype.itemsize, files[file_name]["bytes"]
                    if not isinstance(offset, int) or offset < 0 or offset + nbytes > size:
                        raise CheckpointError(f"checkpoint file {file_name!r}: a manifest entry points at bytes "
                                              f"[{offset}, {offset}+{nbytes}) outside the file ({size} bytes)")
            if covered != r["numel"]:
                raise CheckpointError(f"checkpoint {ckpt_dir!r}: the pieces of parameter {r['fqn']!r} "
                                      f"cover {covered} of its {r['numel']} elements")


def read_range(f: BinaryIO, file_name: str, file_bytes: int, offset: int, out: torch.Tensor) -> None:
    nbytes = out.numel() * out.element_size()
    if not isinstance(offset, int) or offset < 0 or offset + nbytes > file_bytes:
        raise CheckpointError(f"checkpoint file {file_name!r}: a manifest entry points at bytes "
                              f"[{offset}, {offset}+{nbytes}) outside the file ({file_bytes} bytes)")
    f.seek(offset)
    view = out.reshape(-1).view(torch.uint8).numpy()
    if f.readinto(memoryview(view)) != nbytes:
        raise CheckpointError(f"checkpoint file {file_name!r}: short read at offset {offset}")


class PieceReader:
    """Reads ranges of a checkpoint's files, keeping each file open once opened."""

    def __init__(self, ckpt_dir: str, files: Dict[str, Dict[str, Any]]) -> None:
        self.ckpt_dir = ckpt_dir
        self.files = files
        self._handles: Dict[str, BinaryIO] = {}

    def read(self, file_name: str, offset: int, out: torch.Tensor) -> None:
        if file_name not in self._handles:
            self._handles[file_name] = open(checked_path(self.ckpt_dir, file_name), "rb")
        read_range(self._handles[file_name], file_name, self.files[file_name]["bytes"], offset, out)

    def read_param(self, record: Dict[str, Any], key: str, lo: int, hi: int, out: torch.Tensor) -> None:
        """Elements [lo, hi) of one parameter's ``key`` section ("master", "exp_avg",
        "exp_avg_sq" or "value") into ``out``, from the pieces that hold them."""
        for piece in record["pieces"]:
            a, b = max(piece["start"], lo), min(piece["start"] + piece["numel"], hi)
            if a >= b:
                continue
            dtype = torch.float32 if key != "value" else DTYPES[piece["file_dtype"]]
            part = out[a - lo:b - lo]
            value = part if part.dtype == dtype else torch.empty(b - a, dtype=dtype)
            self.read(piece["file"], piece[key] + dtype.itemsize * (a - piece["start"]), value)
            if value is not part:
                part.copy_(value)

    def close(self) -> None:
        for f in self._handles.values():
            f.close()
        self._handles.clear()
