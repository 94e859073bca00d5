#!/usr/bin/env bash
# What starting a command costs inside a gVisor sandbox, per platform: a perl program run with
# `runsc --platform=P do` times, in the sandbox's own clock, N fork+execve+wait of /usr/bin/echo,
# N of /usr/bin/true, and N execve+wait of /usr/bin/echo in a child forked beforehand (what a
# warm-pool hit pays now that the container supervisor forks the command's process while idle).
# Prints p50 and max per measurement and platform, in milliseconds.
#
#   scripts/profile-gvisor-exec.sh [N [PLATFORMS]]     defaults: 15 "systrap ptrace"
# Needs root and runsc (scripts/setup-docker.sh installs it).
set -Eeuo pipefail
N=${1:-15}
PLATFORMS=${2:-"systrap ptrace"}
command -v runsc >/dev/null || { echo "profile-gvisor-exec: runsc not found (scripts/setup-docker.sh)" >&2; exit 1; }
WORK=$(mktemp -d /tmp/profile-gvisor-exec.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
cat >"$WORK/t.pl" <<'PL'
use strict; use warnings;
my $n = shift;
# clock_gettime(CLOCK_MONOTONIC) by its x86_64 number: perl-base has no Time::HiRes.
sub now { my $b = "\0" x 16; syscall(228, 1, $b); my ($s, $ns) = unpack('q2', $b); return $s * 1000 + $ns / 1e6 }
open(STDOUT, '>', '/dev/null') or die;
for (1 .. $n) {
    my $t = now(); my $p = fork() // die; if (!$p) { exec '/usr/bin/echo', 'hi' } waitpid($p, 0);
    printf STDERR "fork+exec+wait echo %.2f\n", now() - $t;
    $t = now(); $p = fork() // die; if (!$p) { exec '/usr/bin/true' } waitpid($p, 0);
    printf STDERR "fork+exec+wait true %.2f\n", now() - $t;
    pipe(my $r, my $w) or die; $p = fork() // die;
    if (!$p) { close $w; my $go = <$r>; exec '/usr/bin/echo', 'hi' }
    close $r; select(undef, undef, undef, 0.05);
    $t = now(); print $w "go\n"; close $w; waitpid($p, 0);
    printf STDERR "prepared child: exec+wait echo %.2f\n", now() - $t;
}
PL
for p in $PLATFORMS; do
  timeout 300 runsc --platform="$p" --network=none do /usr/bin/perl "$WORK/t.pl" "$N" 2>"$WORK/$p.txt" \
    || { echo "profile-gvisor-exec: runsc --platform=$p failed" >&2; continue; }
  python3 - "$p" "$WORK/$p.txt" <<'PY'
import sys, collections
plat, path = sys.argv[1:3]
d = collections.defaultdict(list)
for line in open(path):
    name, _, v = line.rstrip().rpartition(" ")
    try:
        d[name].append(float(v))
    except ValueError:
        pass
for name, xs in d.items():
    xs.sort()
    print(f"{plat:8} {name:34} n={len(xs):3}  p50 {xs[len(xs) // 2]:7.1f} ms  max {xs[-1]:7.1f} ms")
PY
done
