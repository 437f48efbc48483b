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


def _small_report(layers: int = 2, positions: int = 3) -> dict:
    """The fields the plots read, for a 2-layer build: few enough layers that matplotlib's own
    ticks would be fractional (0, 0.25, 0.5...)."""
    return {"position_errors": [[0.01 * (i + 1)] * positions for i in range(2)],
            "layer_errors": [1e-3] * layers, "layer_local_errors": [1e-4] * layers,
            "layer_local_median": [1e-6] * layers,
            "experts": {"worst_by_layer": [1e-7] * layers, "tolerance": 1e-4, "routed_by_layer": [3] * layers,
                        "checked": 8 * layers},
            "blame_threshold": 1e-2, "blame_threshold_median": 1e-4, "first_bad_layer": 1,
            "steps": [{"step": s, "top1_exact": 2, "top1_near": 0, "top1_wrong": 0, "top5_overlap": 1.0}
                      for s in range(positions)],
            "router_margin": [{"min": 0.1, "median": 0.5}] * layers, "tie": 0.01, "layer_forced": [0, 1]}


def test_layer_and_position_axes_have_whole_ticks_and_legends_sit_outside_the_data():
    from gkbuild import report

    figs = report.plots(_small_report())
    assert [c for c, _ in figs] == ["max |logit error| by sequence and position",
                                    "hidden-state relative error by layer", "top-k agreement by position",
                                    "router margin and forced routings by layer", "routing coverage by layer"]
    counted = legends = 0
    for caption, fig in figs:
        fig.canvas.draw()
        for ax in fig.axes:
            if ax.get_xlabel() in ("layer", "position"):
                lo, hi = sorted(ax.get_xlim())
                ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
                assert ticks and all(float(t).is_integer() for t in ticks), (caption, ticks)
                counted += 1
            assert ax.get_legend() is None, caption  # no legend drawn inside a plot
        for leg in fig.legends:
            box = leg.get_window_extent()
            data = [ax for ax in fig.axes if ax.get_label() != "<colorbar>"]
            assert not any(box.overlaps(ax.get_window_extent()) for ax in data), caption
            handles = {t.get_text() for t in leg.get_texts()}
            series = {lab for ax in data for lab in ax.get_legend_handles_labels()[1]}
            assert handles == series, caption  # one legend names every series, the twin axis's too
            legends += 1
    assert counted == 5 and legends == 4
