"""The save timeline: records from real saves, and the page rendered in a real headless Chromium."""

import os
import shutil
import struct
import subprocess
import zlib

import numpy as np
import pytest

import ckpt_callbacks as cc
from ckpt_callbacks import timeline
from ckpt_callbacks.storage import open_store


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tl") / "run")
    with cc.CheckpointManager(d, retention=[cc.KeepLast(2)]) as m:
        for s in range(1, 6):
            m.save(s, {"w": np.random.default_rng(s).standard_normal((600, 600)).astype(np.float32), "s": s},
                   metrics={"loss": 1.0 / s})
        m.wait_until_finished()
        history = list(m.history)
    return d, history


def test_records_from_stats_keep_every_save_and_phase_order(saved):
    _, history = saved
    recs = timeline.records_from_stats(history)
    assert [r.step for r in recs] == [1, 2, 3, 4, 5]
    assert [r.deleted for r in recs] == [(), (), (1,), (2,), (3,)]
    for r, s in zip(recs, history):
        names = [p[0] for p in r.phases()]
        assert names == ["snapshot", "write", "commit", "gc"]
        offs = [p[1] for p in r.phases()]
        assert offs == sorted(offs) and offs[0] == 0.0
        assert r.end == pytest.approx(s.started + s.blocking_s + s.write_s + s.commit_s + s.gc_s)


def test_records_from_manifests_take_commit_and_gc_from_the_next_save(saved):
    d, history = saved
    recs = timeline.records_from_manifests(open_store(d))
    assert [r.step for r in recs] == [4, 5]
    four = recs[0]
    stats4 = next(s for s in history if s.step == 4)
    assert four.commit_s == stats4.commit_s and four.gc_s == stats4.gc_s and four.deleted == (2,)
    assert four.snapshot_s == stats4.blocking_s
    assert recs[1].commit_s is None and [p[0] for p in recs[1].phases()] == ["snapshot", "write"]
    assert recs[1].metrics == {"loss": 0.2}
    assert timeline.records_from_manifests(open_store(d), last=1)[0].step == 5


def test_a_forced_replacement_shows_its_own_figures_not_those_of_the_save_it_replaced(tmp_path):
    d = str(tmp_path / "run")
    tree = lambda s: {"w": np.full(1000, s, np.float32)}   # noqa: E731
    with cc.CheckpointManager(d, retention=[cc.KeepLast(3)]) as m:
        for s in range(1, 7):
            m.save(s, tree(s))
        m.save(6, tree(60), force=True)   # its manifest's `prev` is the first save of step 6
        m.save(7, tree(7))                # this one's is the replacement's
        m.wait_until_finished()
        history = list(m.history)
    recs = {r.step: r for r in timeline.records_from_manifests(open_store(d))}
    first6, again6 = [h for h in history if h.step == 6]
    assert first6.deleted == (3,) and again6.deleted == ()
    assert recs[6].started == again6.started and recs[6].deleted == () and recs[6].commit_s == again6.commit_s
    assert recs[7].commit_s is None   # the newest: unknown


def test_render_svg_has_one_bar_per_phase_and_handles_empty():
    recs = [timeline.SaveRecord(10, 1000.0, 0.01, 0.2, 0.02, 0.005, 10**6),
            timeline.SaveRecord(20, 1010.0, 0.02, 0.3, None, None, 2 * 10**6)]
    svg = timeline.render_svg(recs)
    # two panels: each recorded phase drawn once over time and once per save
    assert svg.count('class="bar snapshot"') == 4 and svg.count('class="bar commit"') == 2
    assert "step 10" in svg and "step 20" in svg
    assert "no saves recorded" in timeline.render_svg([])
    page = timeline.render_html([])
    assert "0 saves" in page


def _chromium():
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        exe = shutil.which(name)
        if exe:
            return exe
    return None


def _png_colors(path):
    """Distinct RGB(A) pixel values of a PNG (8-bit, non-interlaced), decoded with zlib only."""
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, hdr = 8, b"", None
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            hdr = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    w, h, depth, ctype, _, _, interlace = hdr
    assert depth == 8 and interlace == 0 and ctype in (2, 6)
    bpp = 3 if ctype == 2 else 4
    raw = zlib.decompress(idat)
    stride = w * bpp
    prev = bytearray(stride)
    colors = set()
    for y in range(h):
        f = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b = prev[i]
            c = prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        if y % 4 == 0:
            colors.update(bytes(line[i:i + 3]) for i in range(0, stride, bpp * 2))
        prev = line
    return w, h, colors


def test_timeline_page_renders_in_headless_chromium(saved, tmp_path):
    exe = _chromium()
    if exe is None:
        pytest.skip("no chromium binary on PATH (install it: apt-get install -y chromium); "
                    "the timeline page was not rendered in a real browser")
    _, history = saved
    page = tmp_path / "timeline.html"
    page.write_text(timeline.render_html(timeline.records_from_stats(history)))
    shot = tmp_path / "shot.png"
    cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}",
           "--enable-logging=stderr", "--v=0", "--window-size=1100,800", f"--screenshot={shot}",
           page.as_uri()]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    console = [line for line in p.stderr.splitlines() if ":CONSOLE" in line]
    # the page's own check logs exactly one line: every bar drawn with a non-empty box; any other
    # console line (an exception, a CSP or resource error) fails the test
    n_bars = 2 * sum(len(timeline.records_from_stats([s])[0].phases()) for s in history)
    assert len(console) == 1, console
    assert f'"ckpt-timeline: rendered {n_bars} of {n_bars} bars"' in console[0]
    assert os.path.getsize(shot) > 5000
    w, h, colors = _png_colors(shot)
    assert (w, h) == (1100, 800)
    phase_rgb = {bytes.fromhex(c[1:]) for _, c, _ in timeline.PHASES}
    assert phase_rgb <= colors, "every phase colour appears in the screenshot"
