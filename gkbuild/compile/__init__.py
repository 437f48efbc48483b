"""Trace and compile: one traced contract (the signatures), two backends (inductor .pt2, neuron NEFF)."""
