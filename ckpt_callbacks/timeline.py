"""The save timeline: when each save ran and how long each phase took, as self-contained HTML/SVG.

Example::

    from ckpt_callbacks import timeline
    from ckpt_callbacks.storage import open_store
    recs = timeline.records_from_manifests(open_store("/tmp/run"))   # or records_from_stats(mngr.history)
    open("/tmp/timeline.html", "w").write(timeline.render_html(recs))

Who calls what: `ckpt-callbacks timeline DIR` (any machine, no accelerator) reads the manifests of the
committed steps; a training script can pass `CheckpointManager.history` (this process's `SaveStats`,
including saves that retention has since deleted). Both become `SaveRecord`s, which `render_svg` /
`render_html` draw. Nothing here touches devices or reads array data.

Phases of one save (see docs/concepts.md): snapshot (blocking: the only time training stalls),
write (background, until this process's bytes are durable), commit (barrier, manifest, rename or
commit marker), gc (retention deletions after the commit). A manifest is written before its own
commit, so it holds the snapshot and write times; the commit and gc times of a save are recorded
in the *next* save's manifest (``extra.prev``). The newest step therefore shows them as unknown.
"""

from __future__ import annotations

import dataclasses
import html
import math
import time

from .errors import CheckpointError, StorageUnavailableError

__all__ = ["SaveRecord", "PHASES", "records_from_stats", "records_from_manifests", "render_svg", "render_html"]

PHASES = (("snapshot", "#d62728", "blocking snapshot: training stalls"),
          ("write", "#1f77b4", "background write until durable"),
          ("commit", "#2ca02c", "barrier, manifest, atomic rename / commit marker"),
          ("gc", "#7f7f7f", "retention: deleting old steps"))


@dataclasses.dataclass(frozen=True)
class SaveRecord:
    """One save's phases in wall-clock seconds; None where not recorded."""

    step: int
    started: float
    snapshot_s: float
    write_s: float
    commit_s: float | None = None
    gc_s: float | None = None
    bytes: int = 0
    deleted: tuple = ()
    metrics: dict = dataclasses.field(default_factory=dict)

    def phases(self) -> list[tuple[str, float, float]]:
        """(name, start offset from `started`, duration) of every recorded phase."""
        out, t = [], 0.0
        for name, dur in (("snapshot", self.snapshot_s), ("write", self.write_s),
                          ("commit", self.commit_s), ("gc", self.gc_s)):
            if dur is None:
                break
            out.append((name, t, max(0.0, float(dur))))
            t += max(0.0, float(dur))
        return out

    @property
    def end(self) -> float:
        return self.started + sum(d for _, _, d in self.phases())


def records_from_stats(history) -> list[SaveRecord]:
    """From `CheckpointManager.history` (a list of `SaveStats`)."""
    return [SaveRecord(s.step, s.started, s.blocking_s, s.write_s, s.commit_s, s.gc_s, s.bytes_total,
                       tuple(s.deleted)) for s in history]


def records_from_manifests(store, steps=None, last: int | None = None) -> list[SaveRecord]:
    """From the manifests of committed `steps` (default: all, or the `last` N). Unreadable ones are skipped."""
    from .restore import read_manifest
    steps = sorted(store.committed_steps() if steps is None else steps)
    if last is not None:
        steps = steps[-last:]
    recs, prev = [], {}
    for s in steps:
        try:
            m = read_manifest(store, s)
        except StorageUnavailableError:
            raise
        except CheckpointError:
            continue
        t = m.get("timings") or {}
        extra = m.get("extra") or {}
        p = extra.get("prev")
        if isinstance(p, dict) and isinstance(p.get("step"), int):
            prev.setdefault(p["step"], []).append(p)
        recs.append(SaveRecord(s, float(t.get("started", m.get("time", 0.0))), float(t.get("blocking_s", 0.0)),
                               float(t.get("write_s", 0.0)), bytes=int(m.get("bytes", 0)),
                               metrics=dict(m.get("metrics") or {})))
    out = []
    for r in recs:
        # the figures of the save that wrote this step's manifest: a forced replacement's own, not
        # those of the save it replaced (manifests from before "started" was recorded: by step only)
        p = next((p for p in prev.get(r.step, ()) if p.get("started", r.started) == r.started), None)
        if p:
            r = dataclasses.replace(r, commit_s=_num(p.get("commit_s")), gc_s=_num(p.get("gc_s")),
                                    deleted=tuple(p.get("deleted") or ()))
        out.append(r)
    return out


def _num(v):
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _fmt_s(s: float | None) -> str:
    if s is None:
        return "–"
    return f"{s * 1000:.1f} ms" if s < 1 else f"{s:.2f} s"


def _nice(x: float) -> float:
    """A round tick step near x/5."""
    raw = max(x, 1e-6) / 5
    mag = 10 ** math.floor(math.log10(raw))
    return next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)


def render_svg(records, *, width: int = 960) -> str:
    """Two SVG panels: saves over wall-clock time, and each save's phases from its save() call."""
    recs = sorted(records, key=lambda r: r.started)
    e = html.escape
    left, right, row, top = 110, 20, 22, 34
    plot_w = width - left - right
    parts = []
    if not recs:
        return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="60" role="img">'
                f'<text x="10" y="35" font-family="sans-serif" font-size="14">no saves recorded</text></svg>')
    # panel 1: over time
    t0 = recs[0].started
    span = max(r.end for r in recs) - t0 or 1e-3
    h1 = top + 40
    parts.append(f'<text x="10" y="18" font-size="14" font-weight="bold">Saves over time '
                 f'({len(recs)} saves, {_fmt_s(span)})</text>')
    parts.append(f'<line x1="{left}" y1="{top + 20}" x2="{left + plot_w}" y2="{top + 20}" stroke="#999"/>')
    for r in recs:
        for name, off, dur in r.phases():
            x = left + (r.started + off - t0) / span * plot_w
            w = max(dur / span * plot_w, 1.5)
            color = dict((n, c) for n, c, _ in PHASES)[name]
            parts.append(f'<rect class="bar {name}" x="{x:.2f}" y="{top + 8}" width="{w:.2f}" height="24" '
                         f'fill="{color}" fill-opacity="0.85"><title>step {r.step} {name}: {_fmt_s(dur)}'
                         f'</title></rect>')
    parts.append(f'<text x="{left}" y="{top + 50}" font-size="11" fill="#555">0 s</text>')
    parts.append(f'<text x="{left + plot_w}" y="{top + 50}" font-size="11" fill="#555" '
                 f'text-anchor="end">{_fmt_s(span)}</text>')
    # panel 2: per save, aligned at the save() call
    y0 = h1 + 50
    longest = max(sum(d for _, _, d in r.phases()) for r in recs) or 1e-3
    scale = plot_w / longest
    parts.append(f'<text x="10" y="{y0 - 14}" font-size="14" font-weight="bold">Phases of each save '
                 f'(from the save() call)</text>')
    tick = _nice(longest)
    k = 0
    while k * tick <= longest * 1.0001:
        x = left + k * tick * scale
        parts.append(f'<line x1="{x:.2f}" y1="{y0}" x2="{x:.2f}" y2="{y0 + row * len(recs)}" stroke="#eee"/>')
        parts.append(f'<text x="{x:.2f}" y="{y0 + row * len(recs) + 14}" font-size="10" fill="#555" '
                     f'text-anchor="middle">{_fmt_s(k * tick)}</text>')
        k += 1
    for i, r in enumerate(recs):
        y = y0 + i * row
        parts.append(f'<text x="{left - 8}" y="{y + 15}" font-size="12" text-anchor="end">step {r.step}</text>')
        for name, off, dur in r.phases():
            color = dict((n, c) for n, c, _ in PHASES)[name]
            parts.append(f'<rect class="bar {name}" x="{left + off * scale:.2f}" y="{y + 3}" '
                         f'width="{max(dur * scale, 1.0):.2f}" height="{row - 6}" fill="{color}">'
                         f'<title>step {r.step} {name}: {_fmt_s(dur)}</title></rect>')
    ly = y0 + row * len(recs) + 34
    for j, (name, color, desc) in enumerate(PHASES):
        y = ly + j * 17
        parts.append(f'<rect x="{left}" y="{y - 10}" width="12" height="12" fill="{color}"/>'
                     f'<text x="{left + 18}" y="{y}" font-size="12">{e(name)}: {e(desc)}</text>')
    height = ly + 17 * len(PHASES)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" font-family="sans-serif" role="img" '
            f'aria-label="checkpoint save timeline"><rect width="{width}" height="{height}" fill="#fff"/>'
            + "".join(parts) + "</svg>")


def _table(recs) -> str:
    e = html.escape
    rows = []
    for r in recs:
        metrics = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.metrics.items())
        rows.append(f"<tr><td>{r.step}</td><td>{e(time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(r.started)))}"
                    f"</td><td>{_fmt_s(r.snapshot_s)}</td><td>{_fmt_s(r.write_s)}</td><td>{_fmt_s(r.commit_s)}</td>"
                    f"<td>{_fmt_s(r.gc_s)}</td><td>{r.bytes / 1e6:.2f}</td>"
                    f"<td>{e(' '.join(map(str, r.deleted)))}</td><td>{e(metrics)}</td></tr>")
    return ("<table><thead><tr><th>step</th><th>save() called</th><th>snapshot (stall)</th><th>write</th>"
            "<th>commit</th><th>gc</th><th>MB</th><th>deleted</th><th>metrics</th></tr></thead><tbody>"
            + "".join(rows) + "</tbody></table>")


_CHECK = """<script>
(function () {
  var bars = document.querySelectorAll("svg rect.bar");
  var drawn = 0;
  for (var i = 0; i < bars.length; i++) { var b = bars[i].getBBox(); if (b.width > 0 && b.height > 0) drawn++; }
  document.body.setAttribute("data-bars", String(drawn));
  console.log("ckpt-timeline: rendered " + drawn + " of " + bars.length + " bars");
})();
</script>"""


def render_html(records, *, title: str = "ckpt_callbacks save timeline", source: str = "") -> str:
    """A self-contained page (inline SVG and CSS, no network): the timeline, totals and a table."""
    recs = sorted(records, key=lambda r: r.started)
    e = html.escape
    stall = sum(r.snapshot_s for r in recs)
    bg = sum(r.write_s + (r.commit_s or 0) + (r.gc_s or 0) for r in recs)
    summary = (f"{len(recs)} saves; training stalled {_fmt_s(stall)} in total (snapshots); "
               f"background work {_fmt_s(bg)} (write + commit + gc); {sum(r.bytes for r in recs) / 1e6:.1f} MB")
    return ("<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{e(title)}</title><style>"
            "body{font-family:sans-serif;margin:20px;color:#222}"
            "table{border-collapse:collapse;font-size:12px;margin-top:16px}"
            "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}"
            "</style></head><body>"
            f"<h1 style=\"font-size:18px\">{e(title)}</h1>"
            + (f"<p>{e(source)}</p>" if source else "")
            + f"<p id=\"summary\">{e(summary)}</p>" + render_svg(recs) + _table(recs) + _CHECK + "</body></html>")
