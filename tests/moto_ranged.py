"""moto's S3 server with ranged GETs that read only the bytes asked for (the tests' and the
benchmarks' S3 server: tests/s3server.py).

    python tests/moto_ranged.py -H 127.0.0.1 -p PORT      # the arguments of ``python -m moto.server``

moto 5.2.5 answers a ranged GET by reading the whole object and cutting the range from it:
``S3Response.get_object`` returns ``key.value`` (moto/s3/responses.py:2051), which reads the key's
whole buffer under its lock and copies it (``FakeKey.value``, moto/s3/models.py:200-206), and
``key_response`` then slices the range out of that (``_handle_range_header``,
moto/s3/responses.py:1891-1899, 1785-1834). A build that reads a 120b-shaped checkpoint tensor by
tensor from files of hundreds of MB makes thousands of such GETs: the source is read from moto's
temporary files many times over. moto has no setting for it (moto/settings.py).

The one change, made before moto's own ``main`` starts: while ``get_object`` runs for a request
that has a Range header, ``FakeKey.value`` is a view of the key's stored buffer (its length, and
a slice read under the key's own lock) instead of a copy of all of it. moto's range handling is
untouched: it takes ``len()`` and the one slice ``[begin:end + 1]`` of the view, so a ranged GET
answers the same status, headers and bytes as before. A request whose range moto answers whole
(several ranges, an unparsable one: moto/s3/responses.py:1795-1802, 1816-1822) gets the whole
object as before. Uploads, listings, copies and requests without a range are moto's own code.
"""

from __future__ import annotations

import sys
import threading

from moto.s3.models import FakeKey
from moto.s3.responses import S3Response

_ranged = threading.local()  # the server answers each request in a thread of its own


class KeyView:
    """A key's stored bytes as ``get_object``'s body: ``len`` and a contiguous slice, read on demand."""

    def __init__(self, key: FakeKey):
        self.key = key

    def __len__(self) -> int:
        return self.key.size

    def __getitem__(self, s: slice) -> bytes:
        start, stop, step = s.indices(len(self))
        if step != 1:
            raise ValueError("a key's bytes are read as one contiguous range")
        with self.key.lock:  # FakeKey.value's lock: the buffer's position is shared
            self.key._value_buffer.seek(start)
            return self.key._value_buffer.read(max(0, stop - start))


_value = FakeKey.value
_get_object = S3Response.get_object
_key_response = S3Response.key_response


def value(self: FakeKey):
    return KeyView(self) if getattr(_ranged, "on", False) else _value.fget(self)


def get_object(self: S3Response):
    _ranged.on = bool(self.headers.get("range"))
    try:
        return _get_object(self)
    finally:
        _ranged.on = False


def key_response(self: S3Response, request, full_url, headers):
    status, out_headers, body = _key_response(self, request, full_url, headers)
    if isinstance(body, KeyView):  # a range moto answers with the whole object
        body = body[:]
    return status, out_headers, body


def install() -> None:
    FakeKey.value = property(value, _value.fset)
    S3Response.get_object = get_object
    S3Response.key_response = key_response


if __name__ == "__main__":
    install()
    from moto.server import main

    main(sys.argv[1:])
