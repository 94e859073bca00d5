#!/usr/bin/env python3
"""Writes docs/benchmarks.md and its plot from one `scripts/bench.sh all` run.

Reads a results directory:
  facts-start.json, facts-end.json   scripts/bench/facts.py at the start and end of the run
  runs.tsv                           one line per benchmark: name, JSON file, status
                                     ("ok", "failed (exit N)", "skipped: <why>")
  <name>.json                        what each benchmark wrote to BENCH_JSON:
      {"bench", "series": [{id, label, backend, baseline?, n, errors, p50_ms, p95_ms, p99_ms,
       throughput_per_s, samples_ms}], "ratios": [{id, label, value, target, met}],
       "targets": [{id, label, value, unit, target, met}], "facts": {}}

A series without a "baseline" key is compared with `<prefix>.base<N>` when its id ends in N
(docker.conc8 -> docker.base8), else with `<prefix>.base` (docker.warm -> docker.base), when that
series exists. A benchmark whose file is missing is reported as not run, with its status.

Usage: report.py --results DIR --out docs/benchmarks.md --png docs/benchmarks.png --command CMD
"""

import argparse
import json
import math
import os
import re
import sys

# The benchmarks `scripts/bench.sh all` runs, in report order: name -> what runs it. Used when the
# results directory has no runs.tsv, and to name a benchmark in the report.
BENCHMARKS = {
    "local": "`examples/bench_local.rs`",
    "sessions-local": "`examples/bench_sessions.rs`, BACKEND=local",
    "sessions-runc": "`examples/bench_sessions.rs`, BACKEND=runc",
    "sessions-gvisor": "`examples/bench_sessions.rs`, BACKEND=gvisor",
    "stream-local": "`examples/bench_stream.rs`, SANDBOX_RUNTIME=local",
    "stream-runc": "`examples/bench_stream.rs`, SANDBOX_RUNTIME=runc",
    "mcp-local": "`examples/bench_mcp.rs`",
    "receipts-local": "`examples/bench_receipts.rs`",
    "e2b-local": "`examples/bench_e2b.rs`, BACKEND=local",
    "e2b-runc": "`examples/bench_e2b.rs`, BACKEND=runc",
    "e2b-gvisor": "`examples/bench_e2b.rs`, BACKEND=gvisor",
    "docker": "`scripts/bench-docker.sh` (runc and gvisor)",
}

BACKENDS = {
    "local": "local",
    "runc": "docker (runc)",
    "docker": "docker (runc)",
    "gvisor": "gVisor (runsc)",
    "runsc": "gVisor (runsc)",
}
BACKEND_ORDER = ["local", "docker (runc)", "gVisor (runsc)"]

# Where the analysis of a benchmark's missed targets is kept (what was tried, what the profiles
# showed): the docker and gVisor pages, else the history of the local and session runs.
ANALYSIS = {"docker": "benchmarks-docker.md"}
ANALYSIS_DEFAULT = "benchmarks-history.md"


def load_json(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def read_runs(results):
    """[(name, file, status)] from runs.tsv, or every known benchmark with its default file and no
    status (a results directory put together by hand)."""
    path = os.path.join(results, "runs.tsv")
    if not os.path.exists(path):
        return [(name, f"{name}.json", None) for name in BENCHMARKS]
    runs = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            parts = line.rstrip("\n").split("\t")
            if len(parts) >= 3 and parts[0]:
                runs.append((parts[0], parts[1], parts[2]))
    return runs


def load_results(results):
    """[(name, status, document or None, note)] for every benchmark of the run."""
    out = []
    for name, file, status in read_runs(results):
        path = os.path.join(results, file)
        doc, note = None, None
        if os.path.exists(path):
            try:
                doc = load_json(path)
                if not isinstance(doc.get("series"), list):
                    raise ValueError("no series list")
            except (OSError, ValueError, AttributeError) as e:
                doc, note = None, f"unreadable results ({e})"
        elif status == "ok":
            note = "finished but wrote no results file"
        elif status is None:
            note = "no results file"
        out.append((name, status, doc, note))
    return out


def backend_of(series):
    b = series.get("backend")
    if not b:
        b = series.get("id", "").split(".", 1)[0]
    return BACKENDS.get(b, b)


def baseline_of(series, ids):
    """The id of the same-run series `series` is compared with, or None."""
    if "baseline" in series:
        return series["baseline"] if series["baseline"] in ids else None
    sid = series.get("id", "")
    prefix, _, rest = sid.rpartition(".")
    if not prefix or rest.startswith("base"):
        return None
    m = re.search(r"(\d+)$", rest)
    if m and f"{prefix}.base{m.group(1)}" in ids:
        return f"{prefix}.base{m.group(1)}"
    if f"{prefix}.base" in ids:
        return f"{prefix}.base"
    return None


def num(v, unit=""):
    """A figure with three significant digits or so, '—' when missing."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "—"
    a = abs(v)
    s = f"{v:.3f}" if a < 10 else f"{v:.2f}" if a < 100 else f"{v:.1f}"
    return s + unit


def times(v):
    return "—" if v is None else f"{v:.2f}×"


def met_text(met):
    return "—" if met is None else ("met" if met else "**MISSED**")


def bound_text(target, unit):
    if not target:
        return "—"
    t = target.replace("<=", "≤").replace(">=", "≥")
    return t + unit if unit == "×" else f"{t} {unit}".strip()


def fact_text(v):
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return num(v)
    return v


def md_escape(s):
    return str(s).replace("|", "\\|")


def header(facts_start, facts_end, command, quick):
    f0, f1 = facts_start or {}, facts_end or {}

    def load(f):
        la = f.get("loadavg")
        return " / ".join(f"{x:.2f}" for x in la) if la else "—"

    commit = f0.get("git_commit") or "—"
    if f0.get("git_dirty"):
        commit += " (with uncommitted changes)"
    docker = f0.get("docker_server_version")
    docker = (
        f"server {docker}, client {f0.get('docker_client_version') or '—'}"
        if docker
        else f"dockerd not reachable (client {f0.get('docker_client_version') or 'missing'})"
    )
    runsc = f0.get("runsc_version")
    runsc = (
        f"{runsc}, platform {f0.get('runsc_platform') or 'not registered with dockerd'}"
        " (from /etc/docker/daemon.json)"
        if runsc
        else "not installed"
    )
    rows = [
        ("command", f"`{command}`"),
        ("started", f0.get("time_utc") or "—"),
        ("ended", f1.get("time_utc") or "—"),
        ("load average 1 / 5 / 15 min, start", load(f0)),
        ("load average 1 / 5 / 15 min, end", load(f1)),
        ("git commit", commit),
        ("cores (`nproc`)", f0.get("nproc") or "—"),
        ("kernel (`uname -r`)", f0.get("kernel") or "—"),
        ("cgroup", f0.get("cgroup") or "—"),
        ("Landlock ABI", f0.get("landlock_abi") or "not available"),
        ("docker", docker),
        ("runsc", runsc),
    ]
    if quick:
        rows.append(
            (
                "mode",
                "**quick** (`BENCH_QUICK=1`: a tenth of the samples; a check that the "
                "benchmarks run, not a measurement)",
            )
        )
    lines = ["## This run", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {md_escape(v)} |" for k, v in rows]
    return lines


def runs_table(results):
    lines = ["## Benchmarks of this run", "", "| benchmark | runs | result | parameters |",
             "|---|---|---|---|"]
    for name, status, doc, note in results:
        what = BENCHMARKS.get(name, "—")
        if doc is not None:
            result = f"{len(doc['series'])} series" + (
                "" if status in ("ok", None) else f" ({md_escape(status)})"
            )
        elif status in ("ok", None):
            result = f"not run: {note}"
        else:
            result = f"not run: {md_escape(status)}" + (f"; {note}" if note else "")
        facts = (doc or {}).get("facts") or {}
        params = ", ".join(f"{k}={md_escape(fact_text(v))}" for k, v in facts.items()) or "—"
        lines.append(f"| {name} | {what} | {result} | {params} |")
    return lines


def targets_table(results):
    """Every figure held to a target, met or missed; with the baseline build's figure measured in
    the same run ("before") when the run had one (EXECUTOR_ARM_BASELINE_BIN)."""
    rows, other = [], []
    for name, _status, doc, _note in results:
        if doc is None:
            continue
        for r in doc.get("ratios") or []:
            row = (name, r.get("label") or r.get("id"), times(r.get("value")),
                   bound_text(r.get("target"), "×"), met_text(r.get("met")), times(r.get("before")))
            (rows if r.get("target") else other).append(row)
        for t in doc.get("targets") or []:
            unit = t.get("unit") or ""
            rows.append((name, t.get("label") or t.get("id"), num(t.get("value"), f" {unit}"),
                         bound_text(t.get("target"), unit), met_text(t.get("met")),
                         num(t.get("before"), f" {unit}")))
    with_before = any(r[5] != "—" for r in rows + other)
    lines = ["## Targets", ""]
    if rows:
        missed = sum(1 for r in rows if r[4] != "met")
        lines.append(f"{len(rows) - missed} of {len(rows)} met." + (
            f" **{missed} missed.**" if missed else ""))
        missed_in = sorted({r[0] for r in rows if r[4] != "met"})
        if missed_in:
            lines += ["", "What was tried for the missed targets, and what the profiles showed: " +
                      "; ".join(f"{name}: [{ANALYSIS.get(name, ANALYSIS_DEFAULT)}]"
                                f"({ANALYSIS.get(name, ANALYSIS_DEFAULT)})" for name in missed_in) +
                      "."]
        if with_before:
            lines += ["", "*baseline build*: the same figure of the other build of the daemon "
                      "measured in this run (`EXECUTOR_ARM_BASELINE_BIN`)."]
            lines += ["", "| benchmark | figure | value | target | | baseline build |",
                      "|---|---|---:|---|---|---:|"]
            lines += [f"| {a} | {md_escape(b)} | {c} | {d} | {e} | {f} |"
                      for a, b, c, d, e, f in rows]
        else:
            lines += ["", "| benchmark | figure | value | target | |", "|---|---|---:|---|---|"]
            lines += [f"| {a} | {md_escape(b)} | {c} | {d} | {e} |" for a, b, c, d, e, _f in rows]
    else:
        lines.append("No benchmark with targets ran.")
    if other:
        if with_before:
            lines += ["", "Other same-run ratios:", "", "| benchmark | ratio | value | baseline build |",
                      "|---|---|---:|---:|"]
            lines += [f"| {a} | {md_escape(b)} | {c} | {f} |" for a, b, c, _d, _e, f in other]
        else:
            lines += ["", "Other same-run ratios:", "", "| benchmark | ratio | value |",
                      "|---|---|---:|"]
            lines += [f"| {a} | {md_escape(b)} | {c} |" for a, b, c, _d, _e, _f in other]
    return lines


def backend_tables(results):
    """One section per backend: its sequential series and its concurrent ones."""
    groups = {}
    for name, _status, doc, _note in results:
        if doc is None:
            continue
        series = doc["series"]
        by_id = {s.get("id"): s for s in series}
        for s in series:
            groups.setdefault(backend_of(s), []).append((name, s, by_id))
    order = [b for b in BACKEND_ORDER if b in groups] + sorted(
        b for b in groups if b not in BACKEND_ORDER)
    lines = []
    for backend in order:
        seq = [g for g in groups[backend] if g[1].get("throughput_per_s") is None]
        conc = [g for g in groups[backend] if g[1].get("throughput_per_s") is not None]
        lines += [f"## {backend}", ""]
        if seq:
            lines += ["Sequential (one request at a time), milliseconds:", "",
                      "| benchmark | series | n | errors | p50 | p95 | p99 | same-run baseline "
                      "| baseline p50 | p50 ratio |",
                      "|---|---|---:|---:|---:|---:|---:|---|---:|---:|"]
            for name, s, by_id in seq:
                base = by_id.get(baseline_of(s, by_id))
                ratio = None
                if base and s.get("p50_ms") and base.get("p50_ms"):
                    ratio = s["p50_ms"] / base["p50_ms"]
                lines.append(
                    f"| {name} | {md_escape(s.get('label') or s.get('id'))} | {s.get('n', '—')} "
                    f"| {s.get('errors', 0)} | {num(s.get('p50_ms'))} | {num(s.get('p95_ms'))} "
                    f"| {num(s.get('p99_ms'))} "
                    f"| {md_escape(base.get('label') or base.get('id')) if base else '—'} "
                    f"| {num(base.get('p50_ms')) if base else '—'} | {times(ratio)} |")
            lines.append("")
        if conc:
            lines += ["Concurrent, latency in milliseconds:", "",
                      "| benchmark | series | n | errors | p50 | p95 | p99 | req/s "
                      "| same-run baseline | baseline req/s | throughput ratio |",
                      "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
            for name, s, by_id in conc:
                base = by_id.get(baseline_of(s, by_id))
                ratio = None
                if base and s.get("throughput_per_s") and base.get("throughput_per_s"):
                    ratio = s["throughput_per_s"] / base["throughput_per_s"]
                lines.append(
                    f"| {name} | {md_escape(s.get('label') or s.get('id'))} | {s.get('n', '—')} "
                    f"| {s.get('errors', 0)} | {num(s.get('p50_ms'))} | {num(s.get('p95_ms'))} "
                    f"| {num(s.get('p99_ms'))} | {num(s.get('throughput_per_s'))} "
                    f"| {md_escape(base.get('label') or base.get('id')) if base else '—'} "
                    f"| {num(base.get('throughput_per_s')) if base else '—'} | {times(ratio)} |")
            lines.append("")
    return lines


def plot(results, png):
    """Latency CDFs, one panel per benchmark and backend; baselines dashed; log x axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    panels = []
    for name, _status, doc, _note in results:
        if doc is None:
            continue
        by_backend = {}
        by_id = {s.get("id"): s for s in doc["series"]}
        for s in doc["series"]:
            if s.get("samples_ms"):
                by_backend.setdefault(backend_of(s), []).append(s)
        for backend, series in by_backend.items():
            panels.append((f"{name}: {backend}", series, by_id))
    cols = 2 if len(panels) > 1 else 1
    rows = max(1, math.ceil(len(panels) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(7 * cols, 4.2 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    if not panels:
        axes[0][0].text(0.5, 0.5, "no latency samples in this run", ha="center", va="center")
    for ax, (title, series, by_id) in zip(axes.flat, panels):
        baselines = {baseline_of(s, by_id) for s in series}
        lo, hi = math.inf, 0.0
        for s in series:
            xs = sorted(x for x in s["samples_ms"] if x is not None and x > 0)
            if not xs:
                continue
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            is_base = s.get("id") in baselines or baseline_of(s, by_id) is None
            ax.step([xs[0]] + xs, [0.0] + ys, where="post", linestyle="--" if is_base else "-",
                    label=s.get("label") or s.get("id"))
            lo, hi = min(lo, xs[0]), max(hi, xs[-1])
        ax.set_xscale("log")
        if lo <= hi:
            # At least a factor of 4 wide, so 1-2-5 ticks label it.
            mid = math.sqrt(lo * hi)
            span = max(math.sqrt(hi / lo) * 1.2, 2.0)
            ax.set_xlim(mid / span, mid * span)
        ax.xaxis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _pos: f"{v:g}"))
        ax.xaxis.set_minor_formatter(ticker.NullFormatter())
        ax.set_ylim(0, 1.0)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("latency (ms, log)")
        ax.set_ylabel("fraction of requests")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle("Latency CDFs (solid: executor-arm; dashed: same-run baselines)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(png)), exist_ok=True)
    fig.savefig(png, dpi=90)
    plt.close(fig)


def render(results, facts_start, facts_end, command, quick, png_rel):
    lines = [
        "# Benchmarks",
        "",
        "Generated by `scripts/bench.sh all` from one run: every figure below and the plot come "
        "from the run described here, each beside a baseline measured in the same run. Do not "
        "edit: the next run rewrites this file. Earlier runs, with the analysis of what changed "
        "and why, are in [benchmarks-history.md](benchmarks-history.md); the docker and gVisor "
        "series are defined in [benchmarks-docker.md](benchmarks-docker.md). Each benchmark "
        "writes its series, ratios and targets as JSON when `BENCH_JSON` names a file (the format: "
        "`examples/support/report.rs`); `scripts/bench/report.py` turns them into this page.",
        "",
    ]
    lines += header(facts_start, facts_end, command, quick) + [""]
    lines += runs_table(results) + [""]
    lines += targets_table(results) + [""]
    lines += backend_tables(results)
    lines += ["## Latency distributions", "",
              f"![Latency CDFs per benchmark and backend, log x axis]({png_rel})", ""]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--png", required=True)
    ap.add_argument("--command", required=True)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    results = load_results(args.results)

    def facts(name):
        path = os.path.join(args.results, name)
        return load_json(path) if os.path.exists(path) else None

    plot(results, args.png)
    png_rel = os.path.relpath(os.path.abspath(args.png),
                              os.path.dirname(os.path.abspath(args.out)))
    text = render(results, facts("facts-start.json"), facts("facts-end.json"), args.command,
                  args.quick, png_rel)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {args.out} and {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
