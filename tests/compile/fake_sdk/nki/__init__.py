"""``nki.jit`` (awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/api/generated/nki.jit.html): the
decorator that makes a function an NKI kernel. The fake's kernel runs as Python at trace time; each
torch tensor argument reaches it as an array of the shape it has and the dtype the SDK presents
(``language.presented``: the fake's switchable answer to gkbuild doctor's mx_carrier question). An
array it returns goes back as its torch tensor."""

import functools


class Array:
    """What a kernel is given for a tensor: ``shape``, ``dtype`` (an NKI dtype name) and, for the
    fake's own ops, the torch tensor behind it."""

    def __init__(self, t):
        from .language import presented

        self.tensor, self.shape, self.dtype = t, tuple(t.shape), presented(t)


def jit(fn=None, **_):
    import torch

    def wrap(f):
        @functools.wraps(f)
        def call(*args, **kwargs):
            conv = lambda x: Array(x) if isinstance(x, torch.Tensor) else x  # noqa: E731
            out = f(*map(conv, args), **{k: conv(v) for k, v in kwargs.items()})
            return out.tensor if isinstance(out, Array) else out
        return call

    return wrap(fn) if fn is not None else wrap
