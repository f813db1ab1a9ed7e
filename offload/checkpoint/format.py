"""The checkpoint format, and reading a checkpoint back.

A checkpoint is a directory of raw little-endian files plus ``manifest.json``:

  manifest.json       format/version, the world size and ZeRO stage that wrote it, the config
                      of the run, engine counters (micro-step, loss scale), param-group
                      hyperparameters, each rank's Python/NumPy RNG states, per-parameter
                      entries (fqn, aliases, shape, dtype, Adam step count, and its *pieces*:
                      which file holds which elements, at which byte offsets), and every file
                      with its size and sha256. A ``checksum`` field covers the manifest.
  unit-NNNNN.bin      per unit (``unit-NNNNN-rank-RRRRR.bin`` per unit and rank when several
                      ranks wrote it), for each piece of its trainable elements (at most
                      CHUNK_NUMEL of offload/checkpoint/access.py): fp32 master | exp_avg |
                      exp_avg_sq; then the compute copy of frozen parameters (compute
                      dtype), piece after piece. A parameter's record lists every piece
                      that holds some of its elements.
                      Trainable compute copies are derived (fp32: the master itself;
                      bf16/fp16: the master rounded to nearest even, as the Adam kernel writes
                      them; bf16 with a split master: rounded half away from zero, see
                      [Note: split master] in native/adam/master_split.cpp), so they are not
                      stored.
                      A unit saved with a delayed update pending ("delayed_pending" in its
                      manifest record) has a fourth section in each trainable piece, "lagging": the fp32
                      values of the compute copy the next forward reads, one update behind
                      the master ([Note: delayed updates] in offload/optim/delayed.py).
                      With compact optimizer states ("optimizer_states": "compact" in the
                      manifest; absent: "exact"), each trainable parameter's pieces start on
                      a block of BLOCK_NUMEL elements and hold its states as the engine does
                      ([Note: compact optimizer states]): "high" (the bf16 compute copy),
                      "low" (int8), "exp_avg" (int8 codes), "exp_avg_sq" (uint8 codes),
                      "exp_avg_scales" and "exp_avg_sq_scales" (fp32, one per block):
                      not fp32 states, whose re-encoding may flip the high/low split.
  buffers.bin         the model's persistent buffers (byte offsets in the manifest).
  rng-torch-cpu.bin, rng-torch-cuda-N.bin   torch's RNG states (``-rank-RRRRR`` per rank).

Version 1 manifests (one process, one piece per parameter) are read too: read_manifest
converts them to the current layout. Nothing is unpickled on load.
"""
from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
from typing import Any, BinaryIO, Callable, Dict, List, NoReturn, Optional, Tuple

import torch
from torch import nn

from offload.checkpoint.files import file_digests, reading_engine
from offload.errors import CheckpointError
from offload.io import IOEngine
from offload.memory.compact_codec import BLOCK_NUMEL, num_blocks

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
# [Note: compact optimizer states] the sections of a compact trainable piece: (dtype, per
# block) where per block means one value per BLOCK_NUMEL elements, else one per element
COMPACT_SECTIONS = {"high": (torch.bfloat16, False), "low": (torch.int8, False), "exp_avg": (torch.int8, False),
                    "exp_avg_sq": (torch.uint8, False), "exp_avg_scales": (torch.float32, True),
                    "exp_avg_sq_scales": (torch.float32, True)}


def optimizer_states_of(manifest: Dict[str, Any]) -> str:
    """"exact" or "compact": how the checkpoint holds the optimizer states."""
    return manifest.get("optimizer_states", "exact")


def section_bytes(key: str, numel: int, compact: bool) -> int:
    """Bytes of a trainable piece's section ``key`` of ``numel`` elements."""
    if not compact:
        return numel * 4
    dtype, per_block = COMPACT_SECTIONS[key]
    return (num_blocks(numel) if per_block else numel) * dtype.itemsize


def trainable_sections(manifest: Dict[str, Any], delayed_pending: bool) -> Tuple[str, ...]:
    """The sections of a trainable piece of a unit of ``manifest``."""
    if optimizer_states_of(manifest) == "compact":
        return tuple(COMPACT_SECTIONS)
    return ("master", "exp_avg", "exp_avg_sq") + (("lagging",) if delayed_pending else ())


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
        # O_NOFOLLOW: a checkpoint is its own files, never what a planted link points to
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW)) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {ckpt_dir!r}: {MANIFEST} is missing (an incomplete "
                              "or foreign directory)") from None
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise CheckpointError(f"checkpoint {ckpt_dir!r}: {MANIFEST} is a symbolic link") from None
        raise OSError(error.errno, f"checkpoint {ckpt_dir!r}: cannot read {MANIFEST}: {error.strerror}",
                      path) from error
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
    check_fields(manifest, path)
    files = manifest["files"]
    first, every = share
    hashed: List[Tuple[str, str, int]] = []  # (name, path, size) of this share's files
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
        if i % every == first:
            hashed.append((file_name, file_path, size))
    # [Note: checkpoint reads] in offload/checkpoint/files.py
    digests = file_digests([(path, size) for _, path, size in hashed])
    for (file_name, _, _), digest in zip(hashed, digests):
        if digest != files[file_name].get("sha256"):
            raise CheckpointError(f"checkpoint {ckpt_dir!r}: file {file_name!r} does not match its "
                                  "sha256 checksum (corrupted)")
    if manifest["version"] == 1:
        _upgrade_version_1(manifest)
    _check_pieces(manifest, ckpt_dir)
    return manifest


class _Fields:
    """Checks of a manifest's fields, each failure a CheckpointError that names the manifest
    file and the field (``units[1].entries[0].shape``)."""

    def __init__(self, manifest_path: str) -> None:
        self.manifest_path = manifest_path

    def fail(self, field: str, problem: str) -> NoReturn:
        raise CheckpointError(f"checkpoint manifest {self.manifest_path!r}: field {field!r} {problem}")

    def get(self, obj: Dict[str, Any], key: str, field: str, ok: Callable[[Any], bool], kind: str) -> Any:
        if key not in obj:
            self.fail(field, "is missing")
        if not ok(obj[key]):
            self.fail(field, f"must be {kind}, got {obj[key]!r}"[:300])
        return obj[key]

    def an_object(self, obj: Dict[str, Any], key: str, field: str) -> Dict[str, Any]:
        return self.get(obj, key, field, lambda v: isinstance(v, dict), "an object")

    def a_list(self, obj: Dict[str, Any], key: str, field: str, item: Callable[[Any], bool] = lambda v: True,
               kind: str = "a list") -> List[Any]:
        return self.get(obj, key, field, lambda v: isinstance(v, list) and all(item(x) for x in v), kind)

    def an_int(self, obj: Dict[str, Any], key: str, field: str, lo: int = 0, hi: Optional[int] = None) -> int:
        kind = f"an int >= {lo}" if hi is None else f"an int in [{lo}, {hi}]"
        return self.get(obj, key, field, lambda v: _is_int(v) and v >= lo and (hi is None or v <= hi), kind)

    def a_string(self, obj: Dict[str, Any], key: str, field: str) -> str:
        return self.get(obj, key, field, lambda v: isinstance(v, str), "a string")

    def a_dtype(self, obj: Dict[str, Any], key: str, field: str) -> str:
        return self.get(obj, key, field, lambda v: isinstance(v, str) and v in DTYPES,
                        f"one of {sorted(DTYPES)}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_fields(manifest: Dict[str, Any], manifest_path: str) -> None:
    """Every field load and export read has the type and range they need, so that a
    hand-edited manifest (checksum recomputed) is refused before any state changes, naming
    the field. Values that depend on the model or the optimizer are checked against them
    at load (load.py)."""
    f = _Fields(manifest_path)
    version = f.an_int(manifest, "version", "version", lo=1)
    if version >= 2:
        f.an_int(manifest, "world_size", "world_size", lo=1)
        f.an_int(manifest, "stage", "stage", lo=0, hi=3)
    f.an_object(manifest, "config", "config")
    if "optimizer_states" in manifest:  # [Note: compact optimizer states] absent: "exact"
        f.get(manifest, "optimizer_states", "optimizer_states", lambda v: v in ("exact", "compact"),
              "'exact' or 'compact'")
    f.a_dtype(manifest, "compute_dtype", "compute_dtype")
    engine = f.an_object(manifest, "engine", "engine")
    f.an_int(engine, "micro_step", "engine.micro_step")
    f.get(engine, "loss_scale", "engine.loss_scale", lambda v: _is_number(v) and 0 < v < math.inf,
          "a finite number > 0")
    f.an_int(engine, "good_steps", "engine.good_steps")
    f.get(engine, "last_grad_norm", "engine.last_grad_norm", lambda v: v is None or _is_number(v), "a number or null")
    groups = f.a_list(manifest, "param_groups", "param_groups", lambda v: isinstance(v, dict), "a list of objects")
    files = f.an_object(manifest, "files", "files")
    for name, info in files.items():
        info = f.get(files, name, f"files.{name}", lambda v: isinstance(v, dict), "an object")
        f.an_int(info, "bytes", f"files.{name}.bytes")
        f.get(info, "sha256", f"files.{name}.sha256", lambda v: isinstance(v, str), "a string")
    if version >= 2:
        rng = f.an_object(manifest, "rng", "rng")
        ranks = f.a_list(rng, "ranks", "rng.ranks", lambda v: isinstance(v, dict), "a list of objects")
        if len(ranks) != manifest["world_size"]:
            f.fail("rng.ranks", f"has {len(ranks)} entries for world_size {manifest['world_size']}")
        for r, record in enumerate(ranks):
            _check_rng(f, record, f"rng.ranks[{r}]", files)
    else:
        _check_rng(f, f.an_object(manifest, "rng", "rng"), "rng", files)
    seen: Dict[str, str] = {}
    units = f.a_list(manifest, "units", "units", lambda v: isinstance(v, dict), "a list of objects")
    for i, u in enumerate(units):
        f.a_string(u, "name", f"units[{i}].name")
        # [Note: delayed updates] optional: absent in checkpoints without a pending update
        pending = u.get("delayed_pending", False)
        if "delayed_pending" in u:
            f.get(u, "delayed_pending", f"units[{i}].delayed_pending", lambda v: isinstance(v, bool), "true or false")
        if version == 1:
            f.a_string(u, "file", f"units[{i}].file")
        entries = f.a_list(u, "entries", f"units[{i}].entries", lambda v: isinstance(v, dict), "a list of objects")
        for j, r in enumerate(entries):
            field = f"units[{i}].entries[{j}]"
            fqn = f.a_string(r, "fqn", f"{field}.fqn")
            if fqn in seen:
                f.fail(f"{field}.fqn", f"repeats the parameter {fqn!r} of {seen[fqn]}")
            seen[fqn] = field
            f.a_list(r, "names", f"{field}.names", lambda v: isinstance(v, str), "a list of strings")
            shape = f.a_list(r, "shape", f"{field}.shape", lambda v: _is_int(v) and v >= 0, "a list of ints >= 0")
            f.get(r, "numel", f"{field}.numel", lambda v: v == numel_of(shape), f"{numel_of(shape)} (its shape's)")
            f.a_dtype(r, "dtype", f"{field}.dtype")
            trainable = f.get(r, "trainable", f"{field}.trainable", lambda v: isinstance(v, bool), "true or false")
            if trainable:
                f.an_int(r, "group_index", f"{field}.group_index", lo=0, hi=len(groups) - 1)
                f.an_int(r, "step", f"{field}.step")
                if "optimizer_scalars" in r:  # [Note: elementwise optimizers] name -> [dtype, number]
                    f.get(r, "optimizer_scalars", f"{field}.optimizer_scalars", _scalars_record,
                          'an object of [dtype, number] pairs')
            if version >= 2:
                pieces = f.a_list(r, "pieces", f"{field}.pieces", lambda v: isinstance(v, dict), "a list of objects")
                for k, piece in enumerate(pieces):
                    f.a_string(piece, "file", f"{field}.pieces[{k}].file")
                    f.an_int(piece, "start", f"{field}.pieces[{k}].start")
                    f.an_int(piece, "numel", f"{field}.pieces[{k}].numel", lo=1)
                    keys = trainable_sections(manifest, pending) if trainable else ("value",)
                    for key in keys:
                        f.an_int(piece, key, f"{field}.pieces[{k}].{key}")
                    if not trainable:
                        f.a_dtype(piece, "file_dtype", f"{field}.pieces[{k}].file_dtype")
            elif trainable:
                for key in ("master", "exp_avg", "exp_avg_sq"):
                    f.an_int(r, key, f"{field}.{key}")
            else:
                f.an_int(r, "value", f"{field}.value")
                f.a_dtype(r, "file_dtype", f"{field}.file_dtype")
    buffers = f.a_list(manifest, "buffers", "buffers", lambda v: isinstance(v, dict), "a list of objects")
    for i, b in enumerate(buffers):
        f.a_string(b, "name", f"buffers[{i}].name")
        f.a_list(b, "shape", f"buffers[{i}].shape", lambda v: _is_int(v) and v >= 0, "a list of ints >= 0")
        f.a_dtype(b, "dtype", f"buffers[{i}].dtype")
        f.an_int(b, "offset", f"buffers[{i}].offset")
    if buffers and "buffers.bin" not in files:
        f.fail("files", "does not list 'buffers.bin', which the buffers are in")


def _scalars_record(value: Any) -> bool:
    scalar_dtypes = ("python", "float32", "float64", "int64", "int32", "bool")
    def number(v: Any) -> bool:
        return isinstance(v, (int, float, bool))

    def tensor(v: Any) -> bool:  # [Note: whole-parameter optimizers] [dtype, shape, values]
        return (len(v) == 3 and v[0] in scalar_dtypes[1:] and isinstance(v[1], list) and all(
            isinstance(d, int) and d >= 0 for d in v[1]) and isinstance(v[2], list) and all(map(number, v[2]))
            and len(v[2]) == math.prod(v[1]))
    return isinstance(value, dict) and all(
        isinstance(v, list) and ((len(v) == 2 and v[0] in scalar_dtypes and number(v[1])) or tensor(v))
        for v in value.values())


def _check_rng(f: _Fields, record: Dict[str, Any], field: str, files: Dict[str, Any]) -> None:
    """One rank's RNG states: torch's by device in listed files, Python's, NumPy's (optional).
    Whether the generators accept the values is checked at load (load.py)."""
    torch_files = f.an_object(record, "torch", f"{field}.torch")
    if "cpu" not in torch_files:
        f.fail(f"{field}.torch.cpu", "is missing")
    for device, file_name in torch_files.items():
        if device != "cpu" and not re.fullmatch(r"cuda:\d+", device):
            f.fail(f"{field}.torch", f"names the device {device!r}, not 'cpu' or 'cuda:N'")
        f.get(torch_files, device, f"{field}.torch.{device}", lambda v: isinstance(v, str) and v in files,
              "the name of a file the manifest lists")
    f.get(record, "random", f"{field}.random",
          lambda v: isinstance(v, list) and len(v) == 3 and _is_int(v[0]) and isinstance(v[1], list)
          and all(_is_int(x) for x in v[1]) and (v[2] is None or _is_number(v[2])),
          "[version, [ints], gauss or null] (Python's random.getstate())")
    if "numpy" in record:
        f.get(record, "numpy", f"{field}.numpy",
              lambda v: isinstance(v, list) and len(v) == 5 and isinstance(v[0], str) and isinstance(v[1], list)
              and all(_is_int(x) for x in v[1]) and _is_int(v[2]) and _is_int(v[3]) and _is_number(v[4]),
              "[kind, [ints], pos, has_gauss, gauss] (numpy.random.get_state())")


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
    """Every parameter's pieces cover it once, in listed files, inside those files, and no
    two sections (nor buffers) share a byte."""
    files = manifest["files"]
    ranges: Dict[str, List[Tuple[int, int, str]]] = {}  # file -> (offset, bytes, what)
    compact = optimizer_states_of(manifest) == "compact"
    for u in manifest["units"]:
        keys = {True: trainable_sections(manifest, u.get("delayed_pending", False)), False: ("value",)}
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
                if compact and r["trainable"] and piece["start"] % BLOCK_NUMEL:
                    raise CheckpointError(f"checkpoint {ckpt_dir!r}: a piece of parameter {r['fqn']!r} starts "
                                          f"at element {piece['start']}, not on a block of {BLOCK_NUMEL} "
                                          "(compact states are kept in blocks)")
                covered += piece["numel"]
                dtype = DTYPES.get("float32" if r["trainable"] else piece.get("file_dtype"))
                if dtype is None:
                    raise CheckpointError(f"checkpoint file {file_name!r}: parameter {r['fqn']!r} "
                                          f"has unknown dtype {piece.get('file_dtype')!r}")
                for key in keys[r["trainable"]]:
                    nbytes = section_bytes(key, piece["numel"], compact) if r["trainable"] else \
                        piece["numel"] * dtype.itemsize
                    check_range(file_name, files[file_name]["bytes"], piece.get(key), nbytes)
                    ranges.setdefault(file_name, []).append((piece[key], nbytes, f"{r['fqn']!r} {key}"))
            if covered != r["numel"]:
                raise CheckpointError(f"checkpoint {ckpt_dir!r}: the pieces of parameter {r['fqn']!r} "
                                      f"cover {covered} of its {r['numel']} elements")
    for b in manifest.get("buffers", []):
        shape = b.get("shape")
        if isinstance(b.get("offset"), int) and isinstance(shape, list) and b.get("dtype") in DTYPES:
            ranges.setdefault("buffers.bin", []).append(
                (b["offset"], numel_of(shape) * DTYPES[b["dtype"]].itemsize, f"buffer {b.get('name')!r}"))
    for file_name, spans in ranges.items():  # each byte holds one value: overlaps load one value twice
        spans.sort()
        for (a, a_bytes, a_what), (b, _, b_what) in zip(spans, spans[1:]):
            if b < a + a_bytes:
                raise CheckpointError(f"checkpoint file {file_name!r}: the manifest places {a_what} and {b_what} "
                                      f"on the same bytes ({b} < {a}+{a_bytes})")


def check_range(file_name: str, file_bytes: int, offset: Any, nbytes: int) -> None:
    """A CheckpointError unless bytes [offset, offset + nbytes) lie inside the file."""
    if not isinstance(offset, int) or offset < 0 or offset + nbytes > file_bytes:
        raise CheckpointError(f"checkpoint file {file_name!r}: a manifest entry points at bytes "
                              f"[{offset}, {offset}+{nbytes}) outside the file ({file_bytes} bytes)")


def read_range(f: BinaryIO, file_name: str, file_bytes: int, offset: int, out: torch.Tensor) -> None:
    nbytes = out.numel() * out.element_size()
    check_range(file_name, file_bytes, offset, nbytes)
    f.seek(offset)
    view = out.reshape(-1).view(torch.uint8).numpy()
    if f.readinto(memoryview(view)) != nbytes:
        raise CheckpointError(f"checkpoint file {file_name!r}: short read at offset {offset}")


class PieceReader:
    """Reads ranges of a checkpoint's files through an I/O engine ([Note: checkpoint reads]
    in offload/checkpoint/files.py), which keeps the files open."""

    def __init__(self, ckpt_dir: str, files: Dict[str, Dict[str, Any]]) -> None:
        self.ckpt_dir = ckpt_dir
        self.files = files
        self._io: Optional[IOEngine] = None

    def read(self, file_name: str, offset: int, out: torch.Tensor) -> None:
        check_range(file_name, self.files[file_name]["bytes"], offset, out.numel() * out.element_size())
        if self._io is None:
            self._io = reading_engine()
        self._io.read_into(out.reshape(-1).view(torch.uint8), checked_path(self.ckpt_dir, file_name),
                           offset).wait()

    def read_param(self, record: Dict[str, Any], key: str, lo: int, hi: int, out: torch.Tensor) -> None:
        """Elements [lo, hi) of one parameter's ``key`` section ("master", "exp_avg",
        "exp_avg_sq", "lagging" ([Note: delayed updates]) or "value") into ``out``, from the
        pieces that hold them."""
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
        if self._io is not None:
            self._io.close()
            self._io = None
