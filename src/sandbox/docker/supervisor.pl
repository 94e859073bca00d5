# executor-arm container supervisor: PID 1 of every docker/gvisor sandbox.
#
# Waits (idle, possibly for a long time in the warm pool) for ONE request on stdin, runs it, reports,
# exits. Exiting as PID 1 makes the kernel kill whatever the command left behind. Never a shell:
# argv goes to execve as a list; nothing is interpreted.
#
# Arguments:        UID GID WORKDIR (who the command runs as, and where)
# Request (stdin):  "EAR1" u32be(len) NUL-joined(argc, argv.., envc, "K=V".., stdin_len|-1,
#                   relay_port|0, relay_socket, timeout_ms) stdin-bytes
# Signals:          SIGTERM is passed on to every process of the command (the daemon's grace
#                   before a kill).
# Reply (stdout):   frames  type(1) u32be(len) payload;  o = command stdout, e = command stderr,
#                   x = "exit|signal N broken peak_kib oom_kills pids_max" (last), f = setup failure (last),
#                   u = the egress relay cannot reach the daemon (last), t = the deadline passed (last)
#
# Trust: the supervisor runs as root with only CAP_SETUID and CAP_SETGID (no-new-privileges, the
# container's seccomp profile) and makes itself non-dumpable; the command runs as UID:GID with no
# supplementary groups and no capabilities, so it cannot ptrace this process, read its memory,
# open its descriptors through /proc (its stdout is the report channel) or signal it.
#
# The supervisor outlives neither its daemon nor its run: it keeps reading stdin, which dockerd
# closes when the daemon's attach connection goes (the container has StdinOnce), and it ends the
# run itself a little after the request's timeout, in case the daemon can no longer do it.
#
# Egress relay (relay_port > 0): before the command starts, listen on 127.0.0.1:relay_port and relay
# every connection to the daemon's proxy on the unix socket relay_socket. The container has no other
# network; all policy lives in the daemon's proxy. The relay runs in this process (PID 1), which
# the command cannot kill.
use strict;
use warnings;
use POSIX ();
use Fcntl ();
use Config ();

$SIG{PIPE} = 'IGNORE';
# Bytes in, bytes out, whatever the image's locale or PERL_UNICODE says.
binmode($_, ':raw') for (\*STDIN, \*STDOUT, \*STDERR);

sub eintr { return !defined($_[0]) && $! == POSIX::EINTR() }

# Syscalls perl has no wrapper for, by architecture.
my %NR = (x86_64 => { prctl => 157, getrusage => 98 }, aarch64 => { prctl => 167, getrusage => 165 });
my ($ARCH) = ($Config::Config{archname} // '') =~ /^([^-]+)/;
my $nr = $NR{ $ARCH // '' } // {};
# Seconds the supervisor's own deadline leaves the daemon to end a timed-out run first.
my $DEADLINE_GRACE = 5;

# Exactly $n bytes of the request; EOF (the daemon went away while we were idle) ends the sandbox.
sub rd {
    my ($n) = @_;
    my $b = '';
    while (length($b) < $n) {
        my $r = sysread(STDIN, $b, $n - length($b), length($b));
        next if eintr($r);
        POSIX::_exit(0) unless $r;
    }
    return $b;
}

sub frame {
    my $m = $_[0] . pack('N', length $_[1]) . $_[1];
    while (length $m) {
        my $w = syswrite(STDOUT, $m);
        next if eintr($w);
        POSIX::_exit(3) unless defined $w;
        substr($m, 0, $w, '');
    }
}

sub fail { frame('f', $_[0]); POSIX::_exit(0) }

sub unavailable { frame('u', $_[0]); POSIX::_exit(0) }
sub nonblock { fcntl($_[0], Fcntl::F_SETFL(), fcntl($_[0], Fcntl::F_GETFL(), 0) | Fcntl::O_NONBLOCK()) }

# Before anything else: nothing in this container may trace us or read us through /proc.
my ($UID, $GID, $WORKDIR) = @ARGV;
fail('usage: UID GID WORKDIR') unless defined $WORKDIR && $UID =~ /^[0-9]+$/ && $GID =~ /^[0-9]+$/;
$nr->{prctl} && syscall($nr->{prctl}, 4, 0, 0, 0, 0) == 0    # PR_SET_DUMPABLE 0
    or fail("cannot make the supervisor non-dumpable: $!");

rd(4) eq 'EAR1' or POSIX::_exit(2);
my @f = split /\0/, rd(unpack('N', rd(4))), -1;
my $argc = shift(@f) // 0;
my @argv = splice(@f, 0, $argc);
my $envc = shift(@f) // 0;
my @env = splice(@f, 0, $envc);
my $inlen = shift(@f) // -1;
my $relay_port = shift(@f) || 0;
my $relay_socket = shift(@f) // '';
my $timeout_ms = shift(@f) // 0;
fail('empty argv') unless @argv;
fail('no timeout in the request') unless $timeout_ms =~ /^[0-9]+$/ && $timeout_ms > 0;
my $input = $inlen >= 0 ? rd($inlen) : undef;
my $deadline = time() + int(($timeout_ms + 999) / 1000) + $DEADLINE_GRACE;

# Egress relay state: the loopback listener, and per descriptor of a relayed connection its handle,
# its peer's descriptor, bytes waiting to be written to it, whether it sent EOF, whether we did.
my ($lsn, %rl);
my $RELAY_MAX = 64;       # connections at a time (two descriptors each; nofile is the profile's)
my $RELAY_BUF = 65536;    # bytes buffered per direction
sub uds {
    socket(my $s, Socket::PF_UNIX(), Socket::SOCK_STREAM(), 0) or return;
    connect($s, Socket::pack_sockaddr_un($_[0])) or return;
    return $s;
}
if ($relay_port) {
    require Socket;
    # Fail before the command runs when the daemon's socket is out of reach (e.g. runsc without
    # --host-uds=open). The proxy records nothing for a connection that sends nothing.
    my $probe = uds($relay_socket) or unavailable("egress relay cannot reach the daemon's proxy at $relay_socket: $!");
    close $probe;
    socket($lsn, Socket::PF_INET(), Socket::SOCK_STREAM(), 0) or unavailable("egress relay: socket: $!");
    setsockopt($lsn, Socket::SOL_SOCKET(), Socket::SO_REUSEADDR(), pack('i', 1));
    bind($lsn, Socket::pack_sockaddr_in($relay_port, Socket::INADDR_LOOPBACK()))
        or unavailable("egress relay: cannot listen on 127.0.0.1:$relay_port: $!");
    listen($lsn, 64) or unavailable("egress relay: listen: $!");
    nonblock($lsn);
}

sub relay_watch {
    my ($rb, $wb) = @_;
    vec($$rb, fileno($lsn), 1) = 1 if keys(%rl) < 2 * $RELAY_MAX;
    for my $fd (keys %rl) {
        my $c = $rl{$fd};
        vec($$rb, $fd, 1) = 1 if !$c->{eof} && length($rl{$c->{peer}}{out}) < $RELAY_BUF;
        vec($$wb, $fd, 1) = 1 if length $c->{out};
    }
}

sub relay_close {
    my ($fd) = @_;
    my $c = delete $rl{$fd} or return;
    close $c->{h};
    if (my $p = delete $rl{$c->{peer}}) { close $p->{h} }
}

sub again { return $! == POSIX::EAGAIN() || $! == POSIX::EINTR() }

sub relay_step {
    my ($ro, $wo) = @_;
    if (vec($ro, fileno($lsn), 1) && accept(my $t, $lsn)) {
        if (my $u = uds($relay_socket)) {
            nonblock($_) for ($t, $u);
            $rl{fileno $t} = { h => $t, peer => fileno $u, out => '', eof => 0, shut => 0 };
            $rl{fileno $u} = { h => $u, peer => fileno $t, out => '', eof => 0, shut => 0 };
        } else {
            close $t;
        }
    }
    # Descriptors are non-blocking: a bit left over from a descriptor closed above only yields EAGAIN.
    for my $fd (keys %rl) {
        my $c = $rl{$fd} or next;
        if (vec($ro, $fd, 1) && !$c->{eof}) {
            my $r = sysread($c->{h}, my $buf, $RELAY_BUF);
            if (!defined $r) { relay_close($fd) unless again(); next }
            if ($r) { $rl{$c->{peer}}{out} .= $buf } else { $c->{eof} = 1 }
        }
        if (vec($wo, $fd, 1) && length $c->{out}) {
            my $w = syswrite($c->{h}, $c->{out});
            if (!defined $w) { relay_close($fd) unless again(); next }
            substr($c->{out}, 0, $w, '');
        }
    }
    # An EOF is passed on once what came before it is delivered; a pair is done when both
    # directions are.
    for my $fd (keys %rl) {
        my $c = $rl{$fd} or next;
        my $p = $rl{$c->{peer}};
        if ($c->{eof} && !$p->{shut} && !length $p->{out}) { shutdown($p->{h}, 1); $p->{shut} = 1 }
        relay_close($fd) if $c->{shut} && $p->{shut};
    }
}

pipe(my $or, my $ow) or fail("pipe: $!");
pipe(my $er, my $ew) or fail("pipe: $!");
pipe(my $xr, my $xw) or fail("pipe: $!");
pipe(my $sr, my $sw) or fail("pipe: $!");
my ($ir, $iw);
if (defined $input) { pipe($ir, $iw) or fail("pipe: $!") }
binmode($_, ':raw') for grep { defined } ($or, $ow, $er, $ew, $xr, $xw, $sr, $sw, $ir, $iw);
for my $h ($sr, $sw) { fcntl($h, Fcntl::F_SETFL(), fcntl($h, Fcntl::F_GETFL(), 0) | Fcntl::O_NONBLOCK()) }
# Self-pipe: a SIGCHLD between waitpid and select must still wake select.
$SIG{CHLD} = sub { syswrite($sw, 'c') };
# SIGTERM (the daemon stopping the run with a grace): passed on to every process of the command.
my $term = 0;
$SIG{TERM} = sub { $term = 1; syswrite($sw, 't') };

# The command's identity: no supplementary groups, then the gid, then the uid (each step needs
# the privilege the next one drops), checked before anything of the request runs.
sub become {
    my ($uid, $gid) = @_;
    $) = "$gid $gid";    # setgroups([gid]) and the effective gid
    POSIX::setgid($gid) or return "setgid($gid): $!";
    POSIX::setuid($uid) or return "setuid($uid): $!";
    my @egid = split / /, $);
    my @rgid = split / /, $(;
    return "identity not in effect (uid $< $>, gids $( / $))"
        unless $< == $uid && $> == $uid && $rgid[0] == $gid && !grep { $_ != $gid } @egid;
    return 'root could be regained' if $uid != 0 && POSIX::setuid(0);
    return '';
}

my $pid = fork();
fail("fork: $!") unless defined $pid;
if ($pid == 0) {
    # Ignored signals stay ignored across execve: give the command default dispositions.
    $SIG{PIPE} = 'DEFAULT';
    $SIG{CHLD} = 'DEFAULT';
    $SIG{TERM} = 'DEFAULT';
    my $in = $ir;
    if (!defined $in) { open($in, '<', '/dev/null') or POSIX::_exit(127) }
    # perl opens every fd above 2 close-on-exec, so the command gets exactly 0, 1 and 2: none of
    # ours (the attach streams, the relay's sockets) reaches it.
    POSIX::dup2(fileno($in), 0);
    POSIX::dup2(fileno($ow), 1);
    POSIX::dup2(fileno($ew), 2);
    my $why = become($UID, $GID);
    $why = "chdir $WORKDIR: $!" if !$why && !chdir($WORKDIR);
    if ($why) {
        syswrite($xw, "cannot run as $UID:$GID: $why");
        POSIX::_exit(127);
    }
    %ENV = ();
    for (@env) { my ($k, $v) = split /=/, $_, 2; $ENV{$k} = $v }
    { no warnings 'exec'; exec { $argv[0] } @argv; }
    syswrite($xw, "cannot execute $argv[0]: $!");
    POSIX::_exit(127);
}
close $ow; close $ew; close $xw;
close $ir if defined $ir;

# EOF on the exec pipe: execve succeeded (close-on-exec); anything else: why the command could not
# start.
my $x = '';
while (length($x) < 4096) {
    my $r = sysread($xr, $x, 4096 - length($x), length($x));
    next if eintr($r);
    last unless $r;
}
close $xr;
fail($x) if length $x;

if (defined $iw) { fcntl($iw, Fcntl::F_SETFL(), fcntl($iw, Fcntl::F_GETFL(), 0) | Fcntl::O_NONBLOCK()) }
my %rd = (fileno($or) => [$or, 'o'], fileno($er) => [$er, 'e']);
my ($status, $drain, $broken) = (undef, 0, 0);
while (1) {
    if (time() >= $deadline) {
        frame('t', "the run was still going $DEADLINE_GRACE s after its timeout");
        POSIX::_exit(0);
    }
    # PID 1 reaps every orphan; only the command's status is reported.
    while ((my $w = waitpid(-1, POSIX::WNOHANG())) > 0) { $status = $? if $w == $pid }
    # After the command exits, forward what is already buffered (bounded: a leftover child may
    # keep writing), then stop.
    last if defined $status && (!%rd || $drain++ > 64);
    my ($rb, $wb) = ('', '');
    vec($rb, $_, 1) = 1 for keys %rd;
    vec($rb, fileno($sr), 1) = 1;
    vec($rb, 0, 1) = 1;    # the daemon's end: EOF means it is gone
    vec($wb, fileno($iw), 1) = 1 if defined $iw && !defined $status;
    relay_watch(\$rb, \$wb) if $lsn;
    my $n = select(my $ro = $rb, my $wo = $wb, undef, defined $status ? 0 : 1);
    next if $n < 0;
    last if $n == 0 && defined $status;
    sysread($sr, my $junk, 64) if vec($ro, fileno($sr), 1);
    if ($term == 1) {
        # SIGTERM to every process of the command, from a helper with the command's identity:
        # kill(-1) reaches every process that uid may signal except PID 1 and the helper itself,
        # i.e. the command and everything it started, setsid'd or double-forked ones included.
        # (This process keeps no CAP_KILL, so it could not signal them itself.)
        $term = 2;
        my $helper = fork();
        if (defined $helper && $helper == 0) {
            $SIG{TERM} = 'DEFAULT';
            POSIX::_exit(1) if become($UID, $GID);
            kill('TERM', -1);
            POSIX::_exit(0);
        }
    }
    if (vec($ro, 0, 1)) {
        my $r = sysread(STDIN, my $extra, 4096);
        # Exiting as PID 1 kills the command and everything it started.
        POSIX::_exit(0) unless $r || eintr($r);
    }
    for my $fd (keys %rd) {
        next unless vec($ro, $fd, 1);
        my ($h, $t) = @{ $rd{$fd} };
        my $r = sysread($h, my $buf, 65536);
        next if eintr($r);
        if ($r) { frame($t, $buf) } else { close $h; delete $rd{$fd} }
    }
    if (defined $iw && vec($wo, fileno($iw), 1)) {
        my $w = syswrite($iw, $input);
        if (defined $w) { substr($input, 0, $w, '') }
        elsif ($! != POSIX::EAGAIN() && $! != POSIX::EINTR()) { $broken = 1; $input = '' }
        if ($input eq '') { close $iw; undef $iw }
    }
    relay_step($ro, $wo) if $lsn;
}
$broken = 1 if defined $iw && length $input;

sub first_num {
    for my $p (@_) { open(my $h, '<', $p) or next; my $l = <$h>; return $1 if defined $l && $l =~ /^(\d+)/ }
    return undef;
}
sub keyed {
    my $key = shift;
    for my $p (@_) { open(my $h, '<', $p) or next; while (my $l = <$h>) { return $1 if $l =~ /^\Q$key\E (\d+)/ } }
    return '-';
}
# Peak memory: the container's cgroup when it is visible (runc), else the largest reaped process's
# peak RSS from getrusage(RUSAGE_CHILDREN) (gVisor has no cgroupfs inside the sandbox).
my $peak = first_num('/sys/fs/cgroup/memory/memory.max_usage_in_bytes', '/sys/fs/cgroup/memory.peak');
if (defined $peak) { $peak = int($peak / 1024) }
else {
    my $ru = "\0" x 144;
    $peak = ($nr->{getrusage} && syscall($nr->{getrusage}, -1, $ru) == 0) ? (unpack('q18', $ru))[4] : '-';
}
my $oom = keyed('oom_kill', '/sys/fs/cgroup/memory/memory.oom_control', '/sys/fs/cgroup/memory.events');
my $pmax = keyed('max', '/sys/fs/cgroup/pids/pids.events', '/sys/fs/cgroup/pids.events');
my $how = POSIX::WIFSIGNALED($status) ? 'signal ' . POSIX::WTERMSIG($status) : 'exit ' . POSIX::WEXITSTATUS($status);
frame('x', "$how $broken $peak $oom $pmax");
POSIX::_exit(0);
