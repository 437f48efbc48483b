"""Pure layout functions (numpy in, numpy out, no I/O), each paired with the inverse that undoes it."""

LAYOUT_VERSION = 2  # bump when any shard's bytes change for the same inputs (part of every shard's key)
