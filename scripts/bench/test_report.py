"""Tests of scripts/bench/report.py on fixture results: `python -m unittest discover scripts/bench`
in a venv with matplotlib (`scripts/bench.sh test` makes one and runs them)."""

import json
import os
import tempfile
import unittest

import report


def series(sid, label, backend, samples, baseline=None, tput=None, errors=0, **extra):
    s = sorted(samples)
    doc = {
        "id": sid,
        "label": label,
        "backend": backend,
        "n": len(s),
        "errors": errors,
        "p50_ms": s[len(s) // 2],
        "p95_ms": s[-1],
        "p99_ms": s[-1],
        "throughput_per_s": tput,
        "samples_ms": samples,
    }
    if baseline is not False:
        doc["baseline"] = baseline
    doc.update(extra)
    return doc


LOCAL = {
    "bench": "local",
    "series": [
        series("local.execute.seq", "POST /execute echo hi (local, keep-alive)", "local",
               [4.0, 4.2, 4.4, 6.0], baseline="local.bwrap"),
        series("local.bwrap", "bwrap --ro-bind / / --unshare-all /bin/echo", "local",
               [3.5, 3.6, 3.8, 4.0]),
        series("local.conc16", "POST /execute echo hi (16 in flight)", "local",
               [20.0, 22.0, 30.0], baseline="local.bwrap16", tput=180.0, errors=1),
        series("local.bwrap16", "bwrap /bin/echo (16 at a time)", "local",
               [15.0, 16.0, 18.0], tput=200.0),
    ],
    "ratios": [
        {"id": "local.p50_vs_bwrap", "label": "p50 execute / bwrap", "value": 1.05,
         "target": "<= 1.1", "met": True},
        {"id": "local.conc16.tput_vs_bwrap16", "label": "throughput execute / bwrap, 16 in flight",
         "value": 0.9, "target": ">= 1.0", "met": False},
        {"id": "local.p50_vs_fork", "label": "p50 execute / fork-exec", "value": 4.5,
         "target": None, "met": None},
    ],
    "targets": [],
    "facts": {"n_sequential": 4},
}

SESSIONS = {
    "bench": "sessions-local",
    "series": [
        series("sessions.local.exec", "exec print(1) in a warm python session", "local",
               [15.0, 16.0], baseline="sessions.local.execute"),
        series("sessions.local.execute", "/execute python3 -c 'print(1)' (baseline)", "local",
               [14.0, 15.0]),
    ],
    "ratios": [],
    "targets": [{"id": "sessions.local.create.p50", "label": "session create p50 (local)",
                 "value": 0.44, "unit": "ms", "target": "<= 10", "met": True}],
    "facts": {},
}

# As scripts/bench-docker.sh writes it: no "baseline" keys, no samples for some series.
DOCKER = {
    "bench": "docker",
    "series": [
        series("docker.base", "docker run --rm", "runc", [200.0, 210.0, 250.0], baseline=False),
        series("docker.warm", "pool on, sequential", "runc", [7.0, 8.0, 11.0], baseline=False),
        series("docker.base8", "docker run --rm, 8 at a time", "runc", [600.0, 700.0],
               baseline=False, tput=10.0),
        series("docker.conc8", "pool on, concurrency 8", "runc", [500.0, 750.0],
               baseline=False, tput=14.0),
        series("gvisor.warm", "pool on, sequential", "gvisor", [30.0, 33.0], baseline=False,
               samples_ms=[]),
    ],
    "targets": [{"id": "gvisor.warm.p50", "label": "gvisor warm p50", "value": 47.4,
                 "unit": "ms", "target": "<= 40", "met": False}],
    "facts": {"runsc_version": "0.0~20240729.0", "runsc_platform": "systrap"},
}

FACTS = {
    "time_utc": "2026-11-28 00:00:00 UTC",
    "loadavg": [0.5, 0.4, 0.3],
    "nproc": 2,
    "kernel": "6.18.0",
    "cgroup": "v1 (hybrid: v1 controllers, v2 at /sys/fs/cgroup/unified)",
    "landlock_abi": 7,
    "runsc_version": "0.0~20240729.0",
    "runsc_platform": "systrap",
    "docker_server_version": "20.10.24",
    "docker_client_version": "28.2.2",
    "git_commit": "0123456789ab",
    "git_dirty": False,
}


class ReportTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)
        self.results = os.path.join(self.tmp.name, "results")
        os.makedirs(self.results)
        self.out = os.path.join(self.tmp.name, "docs", "benchmarks.md")
        self.png = os.path.join(self.tmp.name, "docs", "benchmarks.png")
        self.write("facts-start.json", FACTS)
        self.write("facts-end.json", {"time_utc": "2026-11-28 00:10:00 UTC",
                                      "loadavg": [1.5, 1.0, 0.5]})
        self.write("local.json", LOCAL)
        self.write("sessions-local.json", SESSIONS)

    def write(self, name, doc):
        with open(os.path.join(self.results, name), "w", encoding="utf-8") as f:
            json.dump(doc, f)

    def runs(self, lines):
        with open(os.path.join(self.results, "runs.tsv"), "w", encoding="utf-8") as f:
            f.write("".join("\t".join(line) + "\n" for line in lines))

    def generate(self, *extra):
        rc = report.main(["--results", self.results, "--out", self.out, "--png", self.png,
                          "--command", "scripts/bench.sh all", *extra])
        self.assertEqual(rc, 0)
        with open(self.out, encoding="utf-8") as f:
            return f.read()

    def assert_png(self):
        with open(self.png, "rb") as f:
            self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")
        self.assertGreater(os.path.getsize(self.png), 10_000)

    def test_missing_docker_file_and_missed_target(self):
        self.runs([
            ("local", "local.json", "ok"),
            ("sessions-local", "sessions-local.json", "ok"),
            ("stream-local", "stream-local.json", "failed (exit 101)"),
            ("docker", "docker.json", "skipped: dockerd not reachable"),
        ])
        md = self.generate("--quick")
        self.assert_png()
        self.assertIn("| docker | `scripts/bench-docker.sh` (runc and gvisor) | "
                      "not run: skipped: dockerd not reachable |", md)
        self.assertIn("not run: failed (exit 101)", md)
        self.assertIn("| local | throughput execute / bwrap, 16 in flight | 0.90× | ≥ 1.0× "
                      "| **MISSED** |", md)
        self.assertIn("| local | p50 execute / bwrap | 1.05× | ≤ 1.1× | met |", md)
        self.assertIn("| sessions-local | session create p50 (local) | 0.440 ms | ≤ 10 ms | met |",
                      md)
        self.assertIn("2 of 3 met. **1 missed.**", md)
        # Ratios without a target are listed apart, not as targets.
        self.assertIn("| local | p50 execute / fork-exec | 4.50× |", md)
        # Sequential row: its baseline and the p50 ratio computed from both.
        self.assertIn("| local | POST /execute echo hi (local, keep-alive) | 4 | 0 | 4.400 | 6.000 "
                      "| 6.000 | bwrap --ro-bind / / --unshare-all /bin/echo | 3.800 | 1.16× |", md)
        # Concurrent row: throughput against the baseline's.
        self.assertIn("| 180.0 | bwrap /bin/echo (16 at a time) | 200.0 | 0.90× |", md)
        self.assertIn("**quick**", md)
        self.assertIn("| cgroup | v1 (hybrid: v1 controllers, v2 at /sys/fs/cgroup/unified) |", md)
        self.assertIn("| load average 1 / 5 / 15 min, end | 1.50 / 1.00 / 0.50 |", md)
        self.assertIn("[benchmarks-history.md](benchmarks-history.md)", md)
        self.assertIn("](benchmarks.png)", md)
        self.assertNotIn("## docker (runc)", md)

    def test_docker_results_without_baseline_keys(self):
        self.write("docker.json", DOCKER)
        md = self.generate()
        self.assert_png()
        self.assertNotIn("**quick**", md)
        self.assertIn("## docker (runc)", md)
        self.assertIn("## gVisor (runsc)", md)
        # docker.warm against docker.base; docker.conc8 against docker.base8.
        self.assertIn("| docker | pool on, sequential | 3 | 0 | 8.000 | 11.00 | 11.00 "
                      "| docker run --rm | 210.0 | 0.04× |", md)
        self.assertIn("| docker run --rm, 8 at a time | 10.00 | 1.40× |", md)
        self.assertIn("| docker | gvisor warm p50 | 47.40 ms | ≤ 40 ms | **MISSED** |", md)
        self.assertIn("runsc_platform=systrap", md)
        # Without runs.tsv every known benchmark is listed; those without a file are not run.
        self.assertIn("| sessions-gvisor | `examples/bench_sessions.rs`, BACKEND=gvisor | "
                      "not run: no results file |", md)

    def test_baseline_build_figures_beside_each_target(self):
        local = json.loads(json.dumps(LOCAL))
        local["ratios"][0]["before"] = 1.22
        local["ratios"][2]["before"] = 4.0
        docker = json.loads(json.dumps(DOCKER))
        docker["targets"][0]["before"] = 61.0
        self.write("local.json", local)
        self.write("docker.json", docker)
        md = self.generate()
        self.assertIn("| local | p50 execute / bwrap | 1.05× | ≤ 1.1× | met | 1.22× |", md)
        # A target without a figure of the baseline build says so.
        self.assertIn("| local | throughput execute / bwrap, 16 in flight | 0.90× | ≥ 1.0× "
                      "| **MISSED** | — |", md)
        self.assertIn("| docker | gvisor warm p50 | 47.40 ms | ≤ 40 ms | **MISSED** | 61.00 ms |",
                      md)
        self.assertIn("| local | p50 execute / fork-exec | 4.50× | 4.00× |", md)
        # Each benchmark with a missed target points at its analysis.
        self.assertIn("docker: [benchmarks-docker.md](benchmarks-docker.md); "
                      "local: [benchmarks-history.md](benchmarks-history.md).", md)

    def test_benchmark_that_wrote_nothing(self):
        self.runs([("local", "local.json", "ok"), ("docker", "docker.json", "ok")])
        md = self.generate()
        self.assertIn("| docker | `scripts/bench-docker.sh` (runc and gvisor) | "
                      "not run: finished but wrote no results file |", md)

    def test_unreadable_results(self):
        with open(os.path.join(self.results, "docker.json"), "w", encoding="utf-8") as f:
            f.write("{not json")
        md = self.generate()
        self.assertIn("| docker | `scripts/bench-docker.sh` (runc and gvisor) | "
                      "not run: unreadable results", md)


if __name__ == "__main__":
    unittest.main()
