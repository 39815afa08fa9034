"""The report half of `ckpt-callbacks bench`: ratios to each peer, target verdicts, text tables.

Example::

    from ckpt_callbacks import bench_workloads as bw
    from ckpt_callbacks.bench_report import ratios, targets, render
    rows = list(bw.WORKLOADS["big"](bw.Context(root="/tmp/b", storage="tmpfs", scale=0.01, repeats=1)))
    result = {"rows": rows, "machine": {"cpus": 2}, "command": "ckpt-callbacks bench", "elapsed_s": 1.0}
    result["ratios"], result["targets"] = ratios(rows), targets(rows, scale=1.0)
    print(render(result))

Who calls what: `bench.main`, after every workload's rows are in (pure functions of the rows).
The targets are issue #10's, stated for ``--scale 1``; at another scale the verdicts are computed
the same way and marked as not comparable.
"""

from __future__ import annotations

__all__ = ["ratios", "targets", "render"]

MiB = 1 << 20
ENGINE = "ckpt_callbacks"
TIMES = ("blocking_s", "durable_s", "restore_s")


def _find(rows, workload, storage, peer, case=None):
    for r in rows:
        if (r["workload"], r["storage"], r["peer"]) == (workload, storage, peer) and not r.get("skipped") \
                and (case is None or r.get("case") == case):
            return r
    return None


def _div(a, b):
    return None if a is None or not b else a / b


def ratios(rows) -> list:
    """This package's time / each peer's time (below 1: we are faster), per workload and storage."""
    out = []
    for r in rows:
        if r["workload"] not in ("big", "small") or r.get("skipped") or r["peer"] == ENGINE:
            continue
        e = _find(rows, r["workload"], r["storage"], ENGINE)
        if e is None:
            continue
        item = {"workload": r["workload"], "storage": r["storage"], "peer": r["peer"]}
        for k in TIMES:
            item[k] = _div(e.get(k), r.get(k))
        if r["peer"] == "raw":  # fraction of the directory's raw write+fsync bandwidth we reach
            item["bandwidth_fraction"] = _div(r["durable_s"], e["durable_s"])
        out.append(item)
    return out


def _t(name, storage, measured, goal, met, unit="s"):
    return {"target": name, "storage": storage, "measured": measured, "goal": goal,
            "met": None if met is None else bool(met), "unit": unit}


def targets(rows, scale: float = 1.0) -> list:
    """Issue #10's targets, one verdict each (met None: a peer or workload was not measured)."""
    out = []
    storages = list(dict.fromkeys(r["storage"] for r in rows))
    for st in storages:
        e, o, raw = (_find(rows, "big", st, p) for p in (ENGINE, "orbax", "raw"))
        if e:
            goal = max(o["blocking_s"], 0.05) if o else 0.05
            out.append(_t("big: blocking <= max(Orbax's, 50 ms)", st, e["blocking_s"], goal,
                          e["blocking_s"] <= goal))
            if st == "tmpfs" and o:
                out.append(_t("big: save <= 1/3 of Orbax's", st, e["durable_s"], o["durable_s"] / 3,
                              e["durable_s"] <= o["durable_s"] / 3))
                out.append(_t("big: restore <= 1/3 of Orbax's", st, e["restore_s"], o["restore_s"] / 3,
                              e["restore_s"] <= o["restore_s"] / 3))
            if st == "disk" and raw:
                frac = raw["durable_s"] / e["durable_s"]
                out.append(_t("big: save bandwidth >= 0.9x raw write+fsync", st, frac, 0.9, frac >= 0.9, "x"))
        e = _find(rows, "small", st, ENGINE)
        if e:
            for k, goal, what in (("blocking_s", 0.5, "blocking"), ("durable_s", 1.0, "save"),
                                  ("restore_s", 1.5, "restore")):
                out.append(_t(f"small: {what} <= {goal} s", st, e[k], goal, e[k] <= goal))
        same = _find(rows, "reshard", st, ENGINE, "4x2 (same)")
        for r in rows:
            if (r["workload"], r["storage"], r["peer"]) != ("reshard", st, ENGINE) or r.get("skipped"):
                continue
            if same and r["case"] != same["case"]:
                x = r["restore_s"] / same["restore_s"]
                out.append(_t(f"reshard -> {r['case']}: restore <= 1.25x same-mesh", st, x, 1.25, x <= 1.25, "x"))
            x = r["bytes_read"] / r["bytes_needed"] if r.get("bytes_needed") else None
            out.append(_t(f"reshard -> {r['case']}: bytes read <= 1.1x needed", st, x, 1.1,
                          None if x is None else x <= 1.1, "x"))
        for r in rows:
            if (r["workload"], r["storage"], r["peer"]) != ("memory", st, ENGINE) or r.get("skipped"):
                continue
            if "growth_bytes" in r:
                allow = max(16 * MiB, 0.1 * r["bytes"])
                out.append(_t(f"memory: {r['case']} without growth (<= {allow / MiB:.0f} MiB)", st,
                              r["growth_bytes"] / MiB, allow / MiB, r["growth_bytes"] <= allow, "MiB"))
            elif r.get("budget"):
                x = r["peak_rss"] / r["budget"]
                out.append(_t(f"memory: peak during save <= 1.1x the budget ({r['case']})", st, x, 1.1,
                              x <= 1.1, "x"))
            else:
                x = r["peak_rss"] / r["bytes"]
                out.append(_t("memory: peak during save <= 1.1x saved bytes", st, x, 1.1, x <= 1.1, "x"))
        for r in rows:  # a cell killed by --cell-timeout: whatever it was measuring never finished
            if r["storage"] == st and str(r.get("skipped", "")).startswith("did not finish"):
                out.append(_t(f"{r['workload']}: every measured save finishes", st, None, None, False, ""))
        e, bw = _find(rows, "stall", st, ENGINE), _find(rows, "stall", st, "d2h", "pinned_host")
        if e:   # 1.25 x bytes / pinned bandwidth + 50 ms = 1.25 x the pinned transfer's time + 50 ms
            goal = 1.25 * bw["seconds"] + 0.05 if bw else None
            out.append(_t("stall: <= 1.25x bytes / pinned device-to-host bandwidth + 50 ms", st, e["stall_s"],
                          goal, None if goal is None else e["stall_s"] <= goal))
        e = _find(rows, "fit", st, ENGINE)
        if e and e.get("overhead") is not None:
            out.append(_t("fit: overhead <= 10%", st, 100 * e["overhead"], 10.0, e["overhead"] <= 0.10, "%"))
    if scale != 1.0:
        for t in out:
            t["note"] = f"measured at --scale {scale}; the targets are stated for --scale 1"
    return out


# -- text --------------------------------------------------------------------------------------
def _f(x, fmt="{:.3f}"):
    return "-" if x is None else fmt.format(x)


def _ms(x):
    return None if x is None else 1e3 * x


def _pct(x):
    return _f(None if x is None else 100 * x, "{:+.1f}%")


def _table(header, lines) -> str:
    cells = [header] + [[str(c) for c in ln] for ln in lines]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    fmt_row = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    return "\n".join([fmt_row(cells[0]), "  ".join("-" * w for w in widths)] + [fmt_row(r) for r in cells[1:]])


def _cells(rows):
    seen = []
    for r in rows:
        if (r["workload"], r["storage"]) not in seen:
            seen.append((r["workload"], r["storage"]))
    return seen


def render(result) -> str:
    rows = result["rows"]
    m = result.get("machine", {})
    parts = [f"$ {result.get('command', 'ckpt-callbacks bench')}   ({result.get('elapsed_s', '?')} s)",
             "machine: " + ", ".join(f"{k}={v}" for k, v in m.items()), ""]
    for wl, st in _cells(rows):
        cell = [r for r in rows if (r["workload"], r["storage"]) == (wl, st)]
        skipped = [f"  {r['peer']}: skipped: {r['skipped']}" for r in cell if r.get("skipped")]
        # this package's rows first (peers that took turns come out in the order they finished)
        cell = sorted((r for r in cell if not r.get("skipped")), key=lambda r: r["peer"] != ENGINE)
        nbytes = max([r.get("bytes") or 0 for r in cell] or [0])
        parts.append(f"== {wl} on {st} ({nbytes / MiB:.0f} MiB; times in s, best of the repeats) ==")
        if wl in ("big", "small", "memory"):
            e = _find(rows, wl, st, ENGINE, cell[0]["case"] if cell and wl != "memory" else None)
            lines = []
            for r in cell:
                if "growth_bytes" in r:
                    continue
                rat = "/".join(_f(_div(e.get(k), r.get(k)), "{:.2f}") for k in TIMES) if e and wl != "memory" else ""
                lines.append([r["peer"] + (f" ({r['case']})" if wl == "memory" else ""), _f(r.get("blocking_s")),
                              _f(r.get("durable_s")), _f(r.get("restore_s")), _f(r.get("peak_rss", 0) / MiB, "{:.0f}"),
                              _f(_div(r.get("peak_rss"), r.get("bytes")), "{:.2f}"), r.get("files", "-"),
                              _f(_div(r["bytes"] / 1e9, r.get("durable_s")), "{:.2f}"), rat, r.get("repeats", "")])
            if lines:
                parts.append(_table(["peer", "blocking", "durable", "restore", "peak MiB", "peak/bytes", "files",
                                     "save GB/s", "ours/peer blk/dur/rst", "n"], lines))
            for r in cell:
                if "growth_bytes" in r:
                    parts.append(f"{r['case']} of {r['bytes'] / MiB:.0f} MiB (KeepLast(2), fresh arrays): RSS "
                                 f"{r['rss_first'] / MiB:.0f} -> {r['rss_last'] / MiB:.0f} MiB, growth "
                                 f"{r['growth_bytes'] / MiB:+.1f} MiB (late vs early median), slope "
                                 f"{r['slope_bytes_per_save'] / 1024:+.1f} KiB/save, median save {r['durable_s']:.3f} s")
        elif wl == "reshard":
            lines = []
            for r in cell:
                same = _find(rows, wl, st, r["peer"], "4x2 (same)")
                lines.append([r["peer"], r["case"], _f(r["restore_s"]), _f(_div(r["restore_s"], same and same["restore_s"]), "{:.2f}"),
                              _f(r["bytes_read"] / MiB, "{:.0f}"), _f(r["bytes_needed"] / MiB, "{:.0f}"),
                              _f(_div(r["bytes_read"], r["bytes_needed"]), "{:.2f}"), r.get("repeats", "")])
            if lines:
                parts.append(_table(["peer", "restore onto", "restore", "x same", "read MiB", "needed MiB",
                                     "read/needed", "n"], lines))
        elif wl == "stall":
            for r in cell:
                if r["peer"] == "d2h":
                    parts.append(f"device-to-host copy of the tree into {r['case']} memory: {r['seconds']:.4f} s, "
                                 f"{r['gbps']:.1f} GB/s ({r['devices']} x {r['device']})")
            o = _find(rows, wl, st, "orbax")
            lines = [[r["peer"], _f(r["blocking_s"], "{:.4f}"), _f(r["stall_s"], "{:+.4f}"),
                      _f(r.get("round_stall_s"), "{:+.4f}"), _f(r["durable_s"]),
                      _f(r["restore_s"]), r["steps"], _f(_ms(r["step_s"]), "{:.2f}"),
                      _f(_div(r["stall_s"], o and o["stall_s"]), "{:.2f}"), "yes" if r["correct"] else "NO",
                      r.get("repeats", "")] for r in cell if r["peer"] != "d2h"]
            if lines:
                parts.append("(stall: a loop of donating training steps with a save before its first step, "
                             "less the same loop alone, best against best; median/round: median of each "
                             "round's difference)")
                parts.append(_table(["peer", "blocking", "stall", "median/round", "durable", "restore", "steps", "step ms",
                                     "stall/Orbax's", "correct", "n"], lines))
        elif wl == "fit":
            lines = [[r["peer"], _f(r["fit_s"]), _pct(r.get("overhead")), _pct(r.get("round_overhead")),
                      _f(r.get("cpu_s")), _f(_ms(r.get("cpu_overhead")), "{:+.0f}"), r.get("repeats", "")] for r in cell]
            if lines:
                parts.append(f"(state {nbytes / MiB:.0f} MiB incl. optimizer; fit of {cell[0]['case']}; "
                             f"overhead: best round vs best round; median/round: median of each round's; "
                             f"cpu: process CPU per fit, median; +cpu ms: median of each round's)")
                parts.append(_table(["callback", "fit s", "overhead", "median/round", "cpu s", "+cpu ms", "n"], lines))
            e = _find(rows, wl, st, ENGINE)
            if e and e.get("blocking_s") is not None:
                parts.append(f"{ENGINE} per fit (medians): blocking {_ms(e['blocking_s']):.0f} ms in the epoch-end "
                             f"saves; the last save's background part {_ms(e['last_save_s']):.0f} ms "
                             f"(on_train_end waits for what is left of it)")
        parts += skipped + [""]
    tg = result.get("targets") or []
    if tg:
        parts.append("== targets (issue #10) ==")
        parts.append(_table(["target", "storage", "measured", "goal", "met"],
                            [[t["target"], t["storage"], _f(t["measured"], "{:.3f}") + " " + t["unit"],
                              _f(t["goal"], "{:.3f}") + " " + t["unit"],
                              {True: "yes", False: "NO", None: "?"}[t["met"]]] for t in tg]))
        if tg[0].get("note"):
            parts.append(f"note: {tg[0]['note']}")
    return "\n".join(parts) + "\n"
