# executor-arm container supervisor: PID 1 of every docker/gvisor sandbox.
#
# Mode "once" (every /execute container): waits (idle, possibly for a long time in the warm pool)
# for ONE request on stdin, runs it, reports, exits. Exiting as PID 1 makes the kernel kill
# whatever the command left behind. The command's process is forked while it waits (see spawn),
# already with the command's identity, and only receives its argv when the request comes.
# Mode "kept" (a session's container): serves requests one after another for the session's life.
# After each run every process of the command's uid is killed before the report, so nothing of
# one exec outlives it; between runs it serves file calls in the workdir. Never a shell: argv goes
# to execve as a list; nothing is interpreted.
#
# Arguments:        UID GID WORKDIR [MODE [AS]] (who the command runs as, where, once|kept, and
#                   the RLIMIT_AS in bytes each command process starts with, 0 for none)
# Run request:      "EAR1" u32be(len) NUL-joined(argc, argv.., envc, "K=V".., stdin_len|-1,
#                   relay_port|0, relay_socket, timeout_ms, code_path|"", code_len|-1, cwd|"")
#                   stdin-bytes code-bytes   (code: kept mode only, written to code_path, a file
#                   of /run/session, read-only to the command, removed after the run)
# File request:     "EARF" u32be(len) NUL-joined(op, path, n) [n bytes for put]   (kept mode)
#                   op: put (n = length), get (n = most bytes), list, dir (is it a directory)
# Signals:          SIGTERM is passed on to every process of the command (the daemon's grace
#                   before a kill); SIGUSR1 kills every process of the command (kept mode's kill of
#                   one exec, which leaves the container running). In kept mode the supervisor
#                   signals them itself (CAP_KILL): the command's uid cannot signal root, so no
#                   process of an exec can stop its own kill.
# Reply (stdout):   frames  type(1) u32be(len) payload;  o = command stdout, e = command stderr,
#                   x = "exit|signal N broken peak_kib oom_kills pids_max" (last), f = setup failure (last),
#                   u = the egress relay cannot reach the daemon (last), t = the deadline passed (last);
#                   to a file request: o = data (get: the bytes; list: "T SIZE NAME\0" records),
#                   then r = "ok" | "err CODE SIZE MESSAGE" (last)
#
# Trust: the supervisor runs as root with only CAP_SETUID and CAP_SETGID (kept mode: and CAP_KILL;
# no-new-privileges, the container's seccomp profile) and makes itself non-dumpable; the command runs as UID:GID with no
# supplementary groups and no capabilities, so it cannot ptrace this process, read its memory,
# open its descriptors through /proc (its stdout is the report channel) or signal it. File calls
# run in a helper with the command's identity (non-dumpable after the switch) that opens every
# path component with O_NOFOLLOW: a symlink the command planted is never followed.
#
# The supervisor outlives neither its daemon nor its run: it keeps reading stdin, which dockerd
# closes when the daemon's attach connection goes (the container has StdinOnce), and it ends the
# run itself a little after the request's timeout, in case the daemon can no longer do it.
#
# Egress relay (relay_port > 0, once mode): before the command starts, listen on 127.0.0.1:relay_port and relay
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
my %NR = (
    x86_64  => { prctl => 157, getrusage => 98,  prlimit64 => 302 },
    aarch64 => { prctl => 167, getrusage => 165, prlimit64 => 261 },
);
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


# A request that cannot run ends with its report: in once mode so does the sandbox, in kept mode
# the next request is awaited.
my $ABANDON = "executor-arm: request abandoned\n";
sub fail { frame('f', $_[0]); die $ABANDON }

sub unavailable { frame('u', $_[0]); die $ABANDON }
sub nonblock { fcntl($_[0], Fcntl::F_SETFL(), fcntl($_[0], Fcntl::F_GETFL(), 0) | Fcntl::O_NONBLOCK()) }

# Egress relay state: the loopback listener, and per descriptor of a relayed connection its handle,
# its peer's descriptor, bytes waiting to be written to it, whether it sent EOF, whether we did.
my ($lsn, %rl, $relay_socket);
my $RELAY_MAX = 64;       # connections at a time (two descriptors each; nofile is the profile's)
my $RELAY_BUF = 65536;    # bytes buffered per direction
sub uds {
    socket(my $s, Socket::PF_UNIX(), Socket::SOCK_STREAM(), 0) or return;
    connect($s, Socket::pack_sockaddr_un($_[0])) or return;
    return $s;
}
sub relay_open {
    my ($relay_port) = @_;
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


# Before anything else: nothing in this container may trace us or read us through /proc.
my ($UID, $GID, $WORKDIR, $MODE, $AS) = @ARGV;
$MODE //= 'once';
$AS   //= 0;
unless (defined $WORKDIR && $UID =~ /^[0-9]+$/ && $GID =~ /^[0-9]+$/ && $MODE =~ /^(once|kept)$/
    && $AS =~ /^[0-9]+$/)
{
    frame('f', 'usage: UID GID WORKDIR [once|kept [AS]]');
    POSIX::_exit(0);
}
my $KEPT = $MODE eq 'kept';
unless ($nr->{prctl} && syscall($nr->{prctl}, 4, 0, 0, 0, 0) == 0) {    # PR_SET_DUMPABLE 0
    frame('f', "cannot make the supervisor non-dumpable: $!");
    POSIX::_exit(0);
}
umask(022);
# Kept mode kills the command's processes itself: it must hold CAP_KILL (bit 5 of CapEff).
if ($KEPT) {
    my $eff = '';
    if (open(my $st, '<', '/proc/self/status')) { while (<$st>) { $eff = $1 if /^CapEff:\s*([0-9a-f]+)/ } }
    unless (length $eff && (hex(substr($eff, -2)) & (1 << 5))) {
        frame('f', 'a kept sandbox needs CAP_KILL for its supervisor');
        POSIX::_exit(0);
    }
}

# Where a kept sandbox's exec code goes: a tmpfs of the container owned by root (this process), so
# the command can read its code but neither change it nor plant the next exec's.
my $CODE_DIR = '/run/session';

# Self-pipe: a SIGCHLD or a signal between waitpid and select must still wake select.
pipe(my $sr, my $sw) or do { frame('f', "pipe: $!"); POSIX::_exit(0) };
binmode($_, ':raw') for ($sr, $sw);
nonblock($_) for ($sr, $sw);
$SIG{CHLD} = sub { syswrite($sw, 'c') };
# SIGTERM (the daemon stopping the run with a grace): passed on to every process of the command.
# SIGUSR1 (kept mode: the daemon killing one exec): every process of the command is killed.
my ($term, $kill) = (0, 0);
$SIG{TERM} = sub { $term = 1; syswrite($sw, 't') };
$SIG{USR1} = sub { $kill = 1; syswrite($sw, 'k') };

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

# Sends $sig to every process of the command. Once mode: from a helper with the command's
# identity (this process keeps no CAP_KILL there): kill(-1) reaches every process that uid may
# signal except PID 1 and the helper itself, i.e. the command and everything it started,
# setsid'd or double-forked ones included. Kept mode: from this process, which holds CAP_KILL
# there, so nothing the command does (it runs as another uid) can stop it.
sub signal_all {
    my ($sig) = @_;
    if ($KEPT) {
        kill($sig, -1);
        return;
    }
    my $helper = fork();
    return unless defined $helper;
    return if $helper;
    $SIG{$_} = 'DEFAULT' for qw(TERM USR1 CHLD);
    POSIX::_exit(1) if become($UID, $GID);
    kill($sig, -1);
    POSIX::_exit(0);
}

# Kept mode, after each exec: every process but this one is killed, pass after pass, until none
# is left (kill(-1) counts a zombie as signalled, so they are reaped between passes). Nothing of
# an exec may run during the next one or a file call; if processes are still there after 3 s,
# this process exits, which as PID 1 ends the whole container (the daemon finds it gone).
sub sweep {
    my $until = time() + 3;
    while (1) {
        my $n = kill('KILL', -1);
        1 while waitpid(-1, POSIX::WNOHANG()) > 0;
        return unless $n;
        if (time() > $until) {
            # The daemon logs this with the container's end (the exec then counts as killed).
            print STDERR "executor-arm supervisor: processes of the exec were still there after 3 s of kills; ending the container\n";
            POSIX::_exit(0);
        }
        select(undef, undef, undef, 0.001);
    }
}

sub first_num {
    for my $p (@_) { open(my $h, '<', $p) or next; my $l = <$h>; return $1 if defined $l && $l =~ /^(\d+)/ }
    return undef;
}
sub keyed {
    my $key = shift;
    for my $p (@_) { open(my $h, '<', $p) or next; while (my $l = <$h>) { return $1 if $l =~ /^\Q$key\E (\d+)/ } }
    return '-';
}
sub oom_kills { keyed('oom_kill', '/sys/fs/cgroup/memory/memory.oom_control', '/sys/fs/cgroup/memory.events') }
sub pids_max_hits { keyed('max', '/sys/fs/cgroup/pids/pids.events', '/sys/fs/cgroup/pids.events') }
# What a counter grew by during one run of a kept sandbox ('-' when it is not visible).
sub grew { my ($before, $after) = @_; return ($before eq '-' || $after eq '-') ? '-' : $after - $before }

# The command's process, forked before its order and waiting for it: once mode makes it while the
# container idles in the pool, because under gVisor forking is the costliest step of a run (the
# sentry copies the address space); kept mode makes it per request. The child takes its
# descriptors (stdin from a pipe, stdout and stderr into the report's pipes) and the command's
# identity at once, then reads its order: whether stdin has bytes, the working directory, argv
# and the environment, which it only ever receives from this process. A failure before execve is
# written to the exec pipe. Returns the parent's ends (pid, order, out, err, exec, in), or why it
# could not fork (a string: nothing is framed here, the request reports it).
sub spawn {
    my @ends = qw(out err exec in order);
    my %p;
    my ($ow, $ew, $xw, $ir, $cr);
    pipe($p{out}, $ow) && pipe($p{err}, $ew) && pipe($p{exec}, $xw) && pipe($ir, $p{in})
        && pipe($cr, $p{order}) or return "pipe: $!";
    binmode($_, ':raw') for (@p{@ends}, $ow, $ew, $xw, $ir, $cr);
    my $pid = fork();
    return "fork: $!" unless defined $pid;
    if ($pid == 0) {
        # Ignored signals stay ignored across execve: give the command default dispositions.
        $SIG{$_} = 'DEFAULT' for qw(PIPE CHLD TERM USR1);
        close $_ for @p{@ends};
        # perl opens every fd above 2 close-on-exec, so the command gets exactly 0, 1 and 2: none of
        # ours (the attach streams, the relay's sockets, the order pipe) reaches it.
        POSIX::dup2(fileno($ir), 0);
        POSIX::dup2(fileno($ow), 1);
        POSIX::dup2(fileno($ew), 2);
        my $why = become($UID, $GID);
        if ($why) {
            syswrite($xw, "cannot run as $UID:$GID: $why");
            POSIX::_exit(127);
        }
        # gVisor: the container's memory cgroup holds the sentry too, and a command that fills it
        # takes the whole sandbox down with it. Below it, an allocation past this limit fails in
        # the command (ENOMEM) and the sentry keeps its headroom.
        if ($AS) {
            my $rl = pack('QQ', $AS, $AS);
            unless ($nr->{prlimit64} && syscall($nr->{prlimit64}, 0, 9, $rl, 0) == 0) {    # RLIMIT_AS
                syswrite($xw, "cannot limit the address space to $AS bytes: $!");
                POSIX::_exit(127);
            }
        }
        my $order = '';
        while (1) {
            my $r = sysread($cr, $order, 65536, length $order);
            next if eintr($r);
            last unless $r;
        }
        my ($has_in, $cwd, $argc, @rest) = split /\0/, $order, -1;
        # No order (the request was abandoned): nothing runs.
        unless (defined $argc && $argc > 0) {
            syswrite($xw, "the order of the command's process was incomplete");
            POSIX::_exit(127);
        }
        my @argv = splice(@rest, 0, $argc);
        if (!$has_in) {
            my $null;
            unless (open($null, '<', '/dev/null')) {
                syswrite($xw, "cannot open /dev/null for stdin: $!");
                POSIX::_exit(127);
            }
            POSIX::dup2(fileno($null), 0);
        }
        own_workspace();
        unless (chdir($cwd)) {
            syswrite($xw, "cannot run as $UID:$GID: chdir $cwd: $!");
            POSIX::_exit(127);
        }
        %ENV = ();
        for (@rest) { my ($k, $v) = split /=/, $_, 2; $ENV{$k} = $v }
        { no warnings 'exec'; exec { $argv[0] } @argv; }
        syswrite($xw, "cannot execute $argv[0]: $!");
        POSIX::_exit(127);
    }
    close $_ for ($ow, $ew, $xw, $ir, $cr);
    $p{pid} = $pid;
    return \%p;
}
# Once mode: the command's process is made now; if that failed, the request tries again and
# reports why it could not.
my $prepared = $KEPT ? undef : spawn();

# One run request, after its magic: reads it, runs it, reports.
sub run_request {
    my @f = split /\0/, rd(unpack('N', rd(4))), -1;
    my $argc = shift(@f) // 0;
    my @argv = splice(@f, 0, $argc);
    my $envc = shift(@f) // 0;
    my @env = splice(@f, 0, $envc);
    my $inlen = shift(@f) // -1;
    my $relay_port = shift(@f) || 0;
    $relay_socket = shift(@f) // '';
    my $timeout_ms = shift(@f) // 0;
    my $code_path = shift(@f) // '';
    my $code_len = shift(@f) // -1;
    my $cwd = shift(@f) // '';
    $cwd = $WORKDIR if $cwd eq '';
    my $input = $inlen >= 0 ? rd($inlen) : undef;
    my $code = $code_len >= 0 ? rd($code_len) : undef;
    fail('empty argv') unless @argv;
    fail('no timeout in the request') unless $timeout_ms =~ /^[0-9]+$/ && $timeout_ms > 0;
    fail('a kept sandbox has no egress relay') if $KEPT && $relay_port;
    fail("cwd $cwd is not inside $WORKDIR")
        unless ($cwd eq $WORKDIR || index($cwd, "$WORKDIR/") == 0) && !grep { $_ eq '..' } split m{/}, $cwd;
    my $deadline = time() + int(($timeout_ms + 999) / 1000) + $DEADLINE_GRACE;
    ($term, $kill) = (0, 0);
    relay_open($relay_port) if $relay_port;
    if (defined $code) {
        fail('code files are for kept sandboxes') unless $KEPT;
        fail("code path $code_path is not a file of $CODE_DIR")
            unless $code_path =~ m{^\Q$CODE_DIR\E/[A-Za-z0-9][A-Za-z0-9._-]*$};
        sysopen(my $c, $code_path, Fcntl::O_WRONLY() | Fcntl::O_CREAT() | Fcntl::O_TRUNC() | Fcntl::O_NOFOLLOW(), 0644)
            or fail("cannot write the code to $code_path: $!");
        binmode($c, ':raw');
        my $left = $code;
        while (length $left) {
            my $w = syswrite($c, $left);
            next if eintr($w);
            fail("cannot write the code to $code_path: $!") unless defined $w;
            substr($left, 0, $w, '');
        }
        close($c) or fail("cannot write the code to $code_path: $!");
    }
    my ($oom0, $pmax0) = $KEPT ? (oom_kills(), pids_max_hits()) : ('-', '-');

    # The order: whether stdin has bytes, the working directory, then argv and the environment.
    my $order0 = join("\0", defined($input) ? 1 : 0, $cwd, scalar(@argv), @argv, @env);
    my ($p, $x);
    for my $try (1, 2) {
        $p = ref($prepared) ? $prepared : spawn();
        undef $prepared;
        fail($p) unless ref $p;
        # A child that already ended reads none of the order; the failed write is only EPIPE
        # (SIGPIPE is ignored here).
        my $order = $order0;
        while (length $order) {
            my $w = syswrite($p->{order}, $order);
            next if eintr($w);
            last unless defined $w;
            substr($order, 0, $w, '');
        }
        close $p->{order};
        # EOF on the exec pipe: execve succeeded (close-on-exec); anything else: why the command
        # could not start.
        $x = '';
        while (length($x) < 4096) {
            my $r = sysread($p->{exec}, $x, 4096 - length($x), length($x));
            next if eintr($r);
            last unless $r;
        }
        close $p->{exec};
        last if length($x) || !length($order);
        # It ended before taking its whole order and said nothing (killed while the container
        # idled): nothing of the request ran, so a fresh process gets it, once.
        1 while waitpid($p->{pid}, 0) < 0 && $! == POSIX::EINTR();
        $x = "the command's process ended before it received its request (wait status $?)";
    }
    my ($pid, $or, $er, $iw) = @{$p}{qw(pid out err in)};
    unless (defined $input) { close $iw; undef $iw }
    if (length $x) {
        waitpid($pid, 0);
        unlink($code_path) if defined $code;
        fail($x);
    }

    nonblock($iw) if defined $iw;
    my %rd = (fileno($or) => [$or, 'o'], fileno($er) => [$er, 'e']);
    # $swept: kept mode killed whatever the command left once it exited.
    my ($status, $drain, $broken, $swept, $late) = (undef, 0, 0, 0, 0);
    while (1) {
        if (!$late && time() >= $deadline) {
            # Once mode: exiting as PID 1 ends everything. Kept mode: everything of the command
            # is killed, then the report says why.
            unless ($KEPT) {
                frame('t', "the run was still going $DEADLINE_GRACE s after its timeout");
                POSIX::_exit(0);
            }
            $late = 1;
            $kill = 1;
        }
        # PID 1 reaps every orphan; only the command's status is reported.
        while ((my $w = waitpid(-1, POSIX::WNOHANG())) > 0) { $status = $? if $w == $pid }
        if (defined $status && $KEPT && !$swept) {
            # Nothing of an exec outlives it: its leftovers are killed before the report.
            sweep();
            $swept = 1;
        }
        if ($KEPT) {
            # Every writer of the pipes is gone once the sweep is done: read them to their end.
            last if $swept && (!%rd || $drain++ > 256);
        } else {
            # After the command exits, forward what is already buffered (bounded: a leftover child
            # may keep writing), then stop.
            last if defined $status && (!%rd || $drain++ > 64);
        }
        my ($rb, $wb) = ('', '');
        vec($rb, $_, 1) = 1 for keys %rd;
        vec($rb, fileno($sr), 1) = 1;
        vec($rb, 0, 1) = 1;    # the daemon's end: EOF means it is gone
        vec($wb, fileno($iw), 1) = 1 if defined $iw && !defined $status;
        relay_watch(\$rb, \$wb) if $lsn;
        my $n = select(my $ro = $rb, my $wo = $wb, undef, (defined $status && !$KEPT) ? 0 : 0.2);
        next if $n < 0;
        last if $n == 0 && defined $status && !$KEPT;
        sysread($sr, my $junk, 64) if vec($ro, fileno($sr), 1);
        if ($term == 1) {
            $term = 2;
            signal_all('TERM');
        }
        if ($kill == 1) {
            $kill = 2;
            signal_all('KILL');
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
    unlink($code_path) if defined $code;
    if ($late) {
        frame('t', "the run was still going $DEADLINE_GRACE s after its timeout");
        return;
    }

    # Peak memory: the container's cgroup when it is visible (runc), else the largest reaped
    # process's peak RSS from getrusage(RUSAGE_CHILDREN) (gVisor has no cgroupfs inside the
    # sandbox). Both cover the container's whole life, so a kept sandbox reports none.
    my $peak = '-';
    unless ($KEPT) {
        $peak = first_num('/sys/fs/cgroup/memory/memory.max_usage_in_bytes', '/sys/fs/cgroup/memory.peak');
        if (defined $peak) { $peak = int($peak / 1024) }
        else {
            my $ru = "\0" x 144;
            $peak = ($nr->{getrusage} && syscall($nr->{getrusage}, -1, $ru) == 0) ? (unpack('q18', $ru))[4] : '-';
        }
    }
    my ($oom, $pmax) = (oom_kills(), pids_max_hits());
    ($oom, $pmax) = (grew($oom0, $oom), grew($pmax0, $pmax)) if $KEPT;
    my $how = POSIX::WIFSIGNALED($status) ? 'signal ' . POSIX::WTERMSIG($status) : 'exit ' . POSIX::WEXITSTATUS($status);
    frame('x', "$how $broken $peak $oom $pmax");
}

# Kept mode, as the command's user: the workspace stays usable to it whatever an earlier exec
# did to its mode (a chmod 0 would otherwise fail every later exec and file call).
sub own_workspace {
    return unless $KEPT;
    my @st = stat($WORKDIR) or return;
    chmod(($st[2] & 07777) | 0700, $WORKDIR) if ($st[2] & 0700) != 0700;
}

# The helper of a file request: as the command's user, below the workdir, every component opened
# with O_NOFOLLOW. Returns (CODE, SIZE, MESSAGE) on failure, () on success; data goes to $out.
sub errno_code {
    my $e = $! + 0;
    return 'notfound' if $e == POSIX::ENOENT();
    return 'notfile' if $e == POSIX::ELOOP() || $e == POSIX::ENOTDIR() || $e == POSIX::EISDIR() || $e == POSIX::ENXIO();
    return 'nospace' if $e == POSIX::ENOSPC() || $e == POSIX::EDQUOT();
    return 'io';
}
sub file_helper {
    my ($op, $path, $n, $data, $out) = @_;
    my @parts = length($path) ? split(m{/}, $path, -1) : ();
    return ('invalid', 0, 'bad path') if grep { $_ eq '' || $_ eq '.' || $_ eq '..' } @parts;
    my $name = ($op eq 'put' || $op eq 'get') ? pop(@parts) : undef;
    return ('invalid', 0, 'the path names no file') if ($op eq 'put' || $op eq 'get') && !defined $name;
    own_workspace();
    chdir($WORKDIR) or return ('io', 0, "chdir $WORKDIR: $!");
    # A directory component is opened without O_DIRECTORY (gVisor follows a symlink opened with
    # O_DIRECTORY|O_NOFOLLOW), non-blocking (a FIFO must not hang us), then checked to be one.
    my $subdir = sub {
        my ($c) = @_;
        sysopen(my $d, $c, Fcntl::O_RDONLY() | Fcntl::O_NOFOLLOW() | Fcntl::O_NONBLOCK()) or return;
        stat($d) or return;
        unless (-d _) { $! = POSIX::ENOTDIR(); return }
        return $d;
    };
    for my $c (@parts) {
        my $d = $subdir->($c);
        if (!$d) {
            return (errno_code(), 0, "$c: $!") unless $op eq 'put' && $! == POSIX::ENOENT();
            mkdir($c, 0755) or $! == POSIX::EEXIST() or return (errno_code(), 0, "mkdir $c: $!");
            $d = $subdir->($c) or return (errno_code(), 0, "$c: $!");
        }
        chdir($d) or return ('io', 0, "fchdir $c: $!");
        close $d;
    }
    if ($op eq 'dir' || $op eq 'list') {
        return () if $op eq 'dir';
        opendir(my $dh, '.') or return (errno_code(), 0, "opendir: $!");
        while (defined(my $e = readdir $dh)) {
            next if $e eq '.' || $e eq '..';
            my @st = lstat($e) or next;    # removed meanwhile
            my $t = -f _ ? 'f' : -d _ ? 'd' : -l _ ? 'l' : 'o';
            print $out "$t $st[7] $e\0";
        }
        return ();
    }
    if ($op eq 'get') {
        sysopen(my $fh, $name, Fcntl::O_RDONLY() | Fcntl::O_NOFOLLOW() | Fcntl::O_NONBLOCK())
            or return (errno_code(), 0, "$name: $!");
        my @st = stat($fh);
        return ('notfile', 0, "$name is not a regular file") unless -f _;
        return ('toolarge', $st[7], 'too large') if $st[7] > $n;
        binmode($fh, ':raw');
        my $got = 0;
        while (1) {
            my $r = sysread($fh, my $buf, 65536);
            next if eintr($r);
            return ('io', 0, "read: $!") unless defined $r;
            last unless $r;
            $got += $r;
            return ('toolarge', $got, 'too large') if $got > $n;
            print $out $buf;
        }
        return ();
    }
    # put: whole under a name of its own, then renamed over the target (a write that fails half
    # way leaves the old file); what is there must be a regular file or nothing.
    if (my @st = lstat($name)) {
        return ('notfile', 0, "$name is not a regular file") unless -f _;
    } elsif ($! != POSIX::ENOENT()) {
        return (errno_code(), 0, "$name: $!");
    }
    my $tmp = ".upload-$$-" . int(rand(1e9));
    sysopen(my $fh, $tmp, Fcntl::O_WRONLY() | Fcntl::O_CREAT() | Fcntl::O_EXCL() | Fcntl::O_NOFOLLOW(), 0644)
        or return (errno_code(), 0, "create: $!");
    binmode($fh, ':raw');
    my $left = $data;
    while (length $left) {
        my $w = syswrite($fh, $left);
        next if eintr($w);
        if (!defined $w) { my @e = (errno_code(), 0, "write: $!"); unlink $tmp; return @e }
        substr($left, 0, $w, '');
    }
    if (!close($fh)) { my @e = (errno_code(), 0, "write: $!"); unlink $tmp; return @e }
    if (!rename($tmp, $name)) { my @e = (errno_code(), 0, "rename: $!"); unlink $tmp; return @e }
    return ();
}

# One file request, after its magic: a helper does it, this process relays its answer.
sub file_request {
    my ($op, $path, $n) = split /\0/, rd(unpack('N', rd(4))), -1;
    fail('unknown file operation') unless defined $n && $op =~ /^(put|get|list|dir)$/ && $n =~ /^[0-9]+$/;
    my $data = $op eq 'put' ? rd($n) : undef;
    pipe(my $r, my $w) or fail("pipe: $!");
    binmode($_, ':raw') for ($r, $w);
    my $helper = fork();
    fail("fork: $!") unless defined $helper;
    if ($helper == 0) {
        $SIG{$_} = 'DEFAULT' for qw(TERM USR1 CHLD);
        close $r;
        my $why = become($UID, $GID);
        my @err = $why ? ('io', 0, $why) : file_helper($op, $path, $n, $data, $w);
        # The verdict is the last line: a code, a size, a message (no newline in it).
        (my $msg = $err[2] // '') =~ s/[\r\n]/ /g;
        print $w (@err ? "\nerr $err[0] $err[1] $msg" : "\nok");
        close $w;
        POSIX::_exit(0);
    }
    close $w;
    my ($all, $cap) = ('', ($op eq 'get' ? $n : 64 << 20) + 65536);
    while (1) {
        my $got = sysread($r, $all, 65536, length $all);
        next if eintr($got);
        last unless $got;
        if (length($all) > $cap) { kill('KILL', $helper); $all = "\nerr io 0 answer too large"; last }
    }
    close $r;
    1 while waitpid($helper, 0) < 0 && $! == POSIX::EINTR();
    my $cut = rindex($all, "\n");
    my ($body, $verdict) = $cut < 0 ? ('', 'err io 0 the helper gave no answer') : (substr($all, 0, $cut), substr($all, $cut + 1));
    $body = '' unless $verdict eq 'ok';
    for (my $i = 0; $i < length $body; $i += 65536) { frame('o', substr($body, $i, 65536)) }
    frame('r', $verdict);
}

while (1) {
    my $magic = rd(4);
    my $ok = eval {
        if ($magic eq 'EAR1') { run_request() }
        elsif ($KEPT && $magic eq 'EARF') { file_request() }
        else { POSIX::_exit(2) }
        1;
    };
    die $@ if !$ok && $@ ne $ABANDON;
    POSIX::_exit(0) unless $KEPT;
}
