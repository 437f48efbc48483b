"""Pure layout functions (numpy in, numpy out, no I/O), each paired with the inverse that undoes it."""
