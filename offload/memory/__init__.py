"""Memory: where a unit's state lives and how it moves between the tiers.

layout (the resolved modes of a run and the per-unit record of its buffers), budget (the one
budget arithmetic), placement (which tier each unit's compute copy and optimizer states
live on), homes (allocation and the initial state), master_codec (the split master's halves),
materialize (the meta stand-ins; moving the model's state home), residency (fetch/evict).
"""
