"""``nki.jit`` (awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/api/generated/nki.jit.html): the
decorator that makes a function an NKI kernel. The fake's kernels run as Python on the torch tensors
``torch_neuronx.trace`` gives them, so it returns the function (with or without arguments)."""


def jit(fn=None, **_):
    return fn if fn is not None else (lambda f: f)
