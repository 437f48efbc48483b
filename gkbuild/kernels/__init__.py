"""Plain-PyTorch twins of the GK decode and sampling-tail kernels, reading a build's shards."""
