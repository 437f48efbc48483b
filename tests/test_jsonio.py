"""The one JSON reader: strict JSON is UTF-8 without a byte order mark (RFC 8259 section 8.1)."""

import codecs
import json

import pytest

from gkbuild import jsonio
from gkbuild.compile import hostprofile


@pytest.mark.parametrize("encode", [lambda t: codecs.BOM_UTF8 + t.encode(), lambda t: t.encode("utf-16"),
                                    lambda t: t.encode("utf-32")])
def test_a_document_with_a_byte_order_mark_or_not_utf8_is_refused(encode):
    with pytest.raises(jsonio.BadJson, match=r"^doc: not UTF-8 JSON") as e:
        jsonio.loads(encode('{"a": 1}'), "doc")
    assert "\n" not in str(e.value)
    assert jsonio.loads('{"a": 1}'.encode(), "doc") == {"a": 1}


def test_a_host_profile_starting_with_a_bom_is_one_line(tmp_path):
    doc = {"format": hostprofile.FORMAT, "target": "trn3", "profile": {k: None for k in hostprofile.CHOICES}}
    p = tmp_path / "doctor.json"
    p.write_bytes(json.dumps(doc).encode())
    assert hostprofile.load(p, "trn3")["answers"] == doc["profile"]
    p.write_bytes(codecs.BOM_UTF8 + json.dumps(doc).encode())
    with pytest.raises(jsonio.BadJson, match=rf"^host profile {p}: not UTF-8 JSON \(starts with a byte order mark"):
        hostprofile.load(p, "trn3")
