"""verify --report: report.json is what --json prints, report.html parses, is self-contained, and
every plot in it is an embedded PNG."""

import base64
import json
import struct
from html.parser import HTMLParser

import pytest

from gkbuild import recipe
from gkbuild.pipeline.pipeline import compile_build
from tests.conftest import RECIPES, run_cli

pytestmark = pytest.mark.usefixtures("one_thread")
PNG = b"\x89PNG\r\n\x1a\n"


class _Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.imgs, self.links, self.stack, self.text = [], [], [], []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "img":
            self.imgs.append(a)
        if tag in ("link", "script") or (tag == "img" and not a.get("src", "").startswith("data:")):
            self.links.append((tag, a))
        if tag not in ("img", "meta", "br", "link"):
            self.stack.append(tag)

    def handle_endtag(self, tag):
        assert self.stack and self.stack[-1] == tag, (tag, self.stack[-5:])
        self.stack.pop()

    def handle_data(self, data):
        self.text.append(data)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("r") / "b"
    compile_build(recipe.load(RECIPES / "tiny-cpu.yaml"), out=out, quiet=True, compile=False)
    return out


def test_report_json_is_the_cli_json_and_the_html_holds_every_plot(built, tmp_path):
    report = tmp_path / "report"
    r = run_cli("verify", str(built), "--prompt", "Once upon a time", "--steps", "3", "--json", "--report", str(report))
    assert r.returncode == 0, r.stderr
    printed = json.loads(r.stdout)
    assert json.loads((report / "report.json").read_text()) == printed
    assert printed["ok"] and printed["tolerances"] == "tight" and printed["texts"][0]["prompt"] == "Once upon a time"
    page = _Page()
    page.feed((report / "report.html").read_text())
    page.close()
    assert not page.stack and not page.links  # balanced, and nothing loaded from elsewhere
    captions = [i["alt"] for i in page.imgs]
    assert captions == ["max |logit error| by sequence and position", "hidden-state relative error by layer",
                        "top-k agreement by position", "router margin and forced routings by layer",
                        "routing coverage by layer"]
    for img in page.imgs:
        head, data = img["src"].split(",", 1)
        assert head == "data:image/png;base64"
        png = base64.b64decode(data, validate=True)
        assert png[:8] == PNG and png[12:16] == b"IHDR"
        w, h = struct.unpack(">II", png[16:24])
        assert 200 < w < 2000 and 50 < h < 2000
    words = " ".join(page.text)
    assert "PASS" in words and "tight" in words and "Once upon a time" in words


def test_a_failing_verify_reports_the_culprit(built, tmp_path, monkeypatch):
    """A build that fails still writes its report (verify exits 1 after)."""
    import dataclasses

    from gkbuild import report, verify
    from gkbuild.golden import default_prompts, for_checkpoint
    from gkbuild.checkpoint.source import materialize, parse

    g = for_checkpoint(materialize(parse("synth://tiny?layers=2&seed=0")), default_prompts(4096, 2, 4), 2)
    bad = dataclasses.replace(g, final_norm=g.final_norm * 1.01)  # as if the build's final norm were off
    rep = verify.run(built, golden=bad).to_dict()
    assert not rep["ok"] and rep["culprit"] == "the final norm"
    report.write(rep, tmp_path / "r", "t")
    assert "the final norm" in (tmp_path / "r" / "report.html").read_text()
    r = run_cli("verify", str(built), "--golden", str(tmp_path / "missing.safetensors"), "--report", str(tmp_path / "x"))
    assert r.returncode != 0 and not (tmp_path / "x").exists()
