"""Checkpoints of an Engine: save, verify, load, export (issue 7).

A checkpoint is a directory of raw little-endian files plus ``manifest.json``; format.py
describes them, checks every manifest field and reads them back, save.py writes them,
directory.py puts a finished one in place, load.py streams them into an engine's tiers,
export.py turns them into one state dict file (``offload export``). Save
and load reach the engine's states only through a CheckpointAccess (access.py,
[Note: checkpoint access]), which the engine builds at the end of wrap.

The format records logical values, not tier layouts, so a checkpoint loads into an engine
with other tiers, another unit split or another number of ranks, as long as parameter
names, shapes and the trainable set agree. Nothing is unpickled on load. Version 1
manifests (one process, one piece per parameter) are read too.

[Note: sharded checkpoints] With several ranks every rank calls save/load. Save: rank 0
prepares the directory; every rank writes the elements it keeps (its shard of master and
moments at stage >= 1, its chunk of frozen values at stage 3; what every rank holds, rank 0
alone) and its RNG states; rank 0 writes the manifest over all of them and renames the
directory into place. Load: every rank hashes its share of the files, then reads the
elements it keeps from whichever pieces hold them, so a checkpoint of N ranks loads on M.
After every phase the ranks agree: when one failed, every rank raises an error naming it,
and nothing is renamed into place.

[Note: bounded checkpoint memory] Save and load go unit by unit, and through each unit's
states in pieces of at most CHUNK_NUMEL elements (offload/checkpoint/access.py: 32 MiB of
fp32): a save reads a piece of the master, exp_avg and exp_avg_sq and writes them, a load
builds a piece of a home and writes it (a piece of a home that does not start or end on a
page boundary has its edge pages read and patched first). The host holds about three fp32
pieces, not a unit: the 3B model's embedding unit has 4.7 GB of fp32 master and moments,
more than the host budget of a run that size. Compact states ([Note: compact optimizer
states]) go the same way: a save reads each parameter's piece of the high parts and of the
compact home's five arrays (Homes.read_compact_range), a load writes the compute copy in
pieces and the compact home in windows of compact_piece_numel(CHUNK_NUMEL) elements, each
array's part whole pages (access._compact_windows; a packed home, at most 262,144
elements, whole). The buffers they move through (Homes.buffer) are counted:
stats()["checkpoint_buffer_peak_bytes"]. A unit file is a run of pieces, each
parameter's elements in the pieces that cover them (format.py), written with O_DIRECT
through 8 MiB staging buffers, each hashed and written on threads of its own while the next
fills (save.py's _DirectWriter: the page cache's writeback throttles buffered writes). A
load's sha256 check and its reads of the states go through an IOEngine ([Note: checkpoint
reads] in files.py); export copies in 4 MiB chunks.

[Note: atomic checkpoint directory] is in directory.py: every crash of a save leaves a
complete checkpoint at its name, or complete copies beside it that load names.
"""
from offload.checkpoint.access import CheckpointAccess, RunRecord, TrainingState
from offload.checkpoint.export import export_checkpoint, export_pretrained
from offload.checkpoint.format import FORMAT, MANIFEST, VERSION, read_manifest
from offload.checkpoint.load import load_checkpoint
from offload.checkpoint.save import save_checkpoint
from offload.checkpoint.state_dict import load_weights

__all__ = ["CheckpointAccess", "RunRecord", "TrainingState", "FORMAT", "MANIFEST", "VERSION",
           "export_checkpoint", "export_pretrained", "load_checkpoint", "load_weights", "read_manifest", "save_checkpoint"]
