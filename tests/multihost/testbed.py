"""Emulated hosts on one machine, for multi-node tests and benchmarks.

K hosts are K Linux network namespaces, each with its own hostname (a UTS
namespace per launched process tree) and one interface `eth0` at 10.77.0.<i+1>/24.
Two hosts are joined by one veth pair; more hang off a bridge in a namespace
of its own. `rate` shapes every host's outgoing traffic with a tbf qdisc (the
emulated NIC's bandwidth); `delay` needs netem, which some kernels lack (then
it is refused, naming the missing qdisc). Nothing is added to the machine's own
namespace: the addresses exist only inside the namespaces made here.

Commands run across the hosts with the venv's MPICH hydra (`mpiexec`): it runs
in host 0, and reaches the other hosts through a launcher script that enters
their namespaces (hydra's rsh launcher). UCX is told to use TCP over `eth0`
(`UCX_TLS=tcp,self`): otherwise it would find the shared memory every
namespace still shares and the traffic would not cross the link. MPI's view
of the hosts comes from hydra (one proxy per host, so COMM_TYPE_SHARED splits
by emulated host); caffepy's own (socket.gethostname) from the UTS namespace.

Everything is removed on close(), on exit and on SIGTERM / SIGHUP / SIGINT
(with the context manager, or the command line); namespaces left by a testbed
whose process died (kill -9) are removed by the next one.

    from multihost.testbed import TestBed, unavailable
    with TestBed(hosts=2, rate="500mbit") as bed:
        bed.run(["caffepy", "train", "--solver", "s.prototxt"], ranks_per_host=1)

    python -m tests.multihost.testbed --hosts 2 --rate 500mbit -- caffepy train --solver s.prototxt
"""
import argparse
import atexit
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

PREFIX = "cpmh"                  # caffepy multi-host: every namespace made here starts with it
SUBNET = "10.77.0"
DEVICE = "eth0"
_NAME = re.compile(rf"^{PREFIX}(\d+)x(\d+)-")


def _venv_mpiexec():
    return os.path.join(os.path.dirname(sys.executable), "mpiexec")


def _ip(*args, check=True):
    out = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and out.returncode != 0:
        raise TestBedError(f"ip {' '.join(args)}: {out.stderr.strip() or out.returncode}")
    return out


class TestBedError(RuntimeError):
    pass


def unavailable():
    """Why emulated hosts cannot be made here (a sentence), or None when they can."""
    if os.name != "posix" or not sys.platform.startswith("linux"):
        return "emulated hosts need Linux network namespaces"
    if os.geteuid() != 0:
        return "emulated hosts need root (ip netns, veth, tc)"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"emulated hosts need the '{tool}' command (iproute2 / util-linux)"
    if not os.path.exists(_venv_mpiexec()):
        return f"no mpiexec next to {sys.executable} (the mpich wheel installs it)"
    probe = f"{PREFIX}{os.getpid()}x0-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"'ip netns add' fails here: {made.stderr.strip()}"
    try:
        veth = _ip("link", "add", "name", DEVICE, "netns", probe, "type", "veth", "peer", "name",
                   "peer0", "netns", probe, check=False)
        if veth.returncode != 0:
            return f"cannot make a veth pair: {veth.stderr.strip()}"
        uts = subprocess.run(["ip", "netns", "exec", probe, "unshare", "--uts", "--", "hostname", "x"],
                             capture_output=True, text=True)
        if uts.returncode != 0:
            return f"cannot give a namespace its own hostname (unshare --uts): {uts.stderr.strip()}"
    finally:
        _delete_namespace(probe)
    return None


def _delete_namespace(name):
    """End every process inside namespace `name` (all started by a testbed), then delete it
    (its interfaces, and the veth peers outside it, go with it)."""
    pids = _ip("netns", "pids", name, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    for _ in range(50):
        if not _ip("netns", "pids", name, check=False).stdout.split():
            break
        time.sleep(0.05)
    _ip("netns", "del", name, check=False)


def _our_namespaces():
    return [n.split()[0] for n in _ip("netns", "list", check=False).stdout.splitlines()
            if n.startswith(PREFIX)]


def remove_stale():
    """Delete namespaces of testbeds whose process is gone (killed before it could clean up)."""
    for name in _our_namespaces():
        m = _NAME.match(name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            _delete_namespace(name)


class Host:
    def __init__(self, index, namespace):
        self.index = index
        self.namespace = namespace
        self.address = f"{SUBNET}.{index + 1}"
        self.hostname = f"emu-host{index}"

    def __repr__(self):
        return f"<Host {self.hostname} {self.address} in {self.namespace}>"


_LAUNCHER = """#!/bin/sh
# hydra's rsh launcher runs: <this script> <host> <proxy command line>
host=$1; shift
case "$host" in
{cases}
  *) echo "testbed: unknown host '$host'" >&2; exit 1;;
esac
# the proxy command line comes as words for a remote shell: let a shell read it
exec ip netns exec "$ns" unshare --uts -- sh -c 'hostname "$0" && exec sh -c "$1"' "$name" "$*"
"""


class TestBed:
    """K emulated hosts; use as a context manager (or call start() and close())."""

    __test__ = False             # not a pytest test class
    _serial = 0

    def __init__(self, hosts=2, rate=None, delay=None, burst=None):
        if hosts < 1:
            raise TestBedError(f"hosts: must be at least 1, got {hosts}")
        if hosts > 200:
            raise TestBedError(f"hosts: at most 200 fit in {SUBNET}.0/24, got {hosts}")
        self.rate, self.delay, self.burst = rate, delay, burst
        TestBed._serial += 1
        self.tag = f"{PREFIX}{os.getpid()}x{TestBed._serial}-"
        self.hosts = [Host(i, f"{self.tag}h{i}") for i in range(hosts)]
        self.bridge = f"{self.tag}br" if hosts > 2 else None
        self.namespaces = []
        self.processes = []
        self.workdir = None
        self._previous = {}

    # -- building and removing --------------------------------------------------
    def start(self):
        reason = unavailable()
        if reason:
            raise TestBedError(reason)
        remove_stale()
        atexit.register(self.close)          # also when the caller forgets to close
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _build(self):
        for name in [h.namespace for h in self.hosts] + ([self.bridge] if self.bridge else []):
            _ip("netns", "add", name)
            self.namespaces.append(name)
            _ip("-n", name, "link", "set", "lo", "up")
        if len(self.hosts) == 2:
            a, b = self.hosts
            _ip("link", "add", "name", DEVICE, "netns", a.namespace, "type", "veth",
                "peer", "name", DEVICE, "netns", b.namespace)
        elif self.bridge:
            _ip("-n", self.bridge, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.bridge, "link", "set", "br0", "up")
            for h in self.hosts:
                port = f"port{h.index}"
                _ip("link", "add", "name", DEVICE, "netns", h.namespace, "type", "veth",
                    "peer", "name", port, "netns", self.bridge)
                _ip("-n", self.bridge, "link", "set", port, "master", "br0")
                _ip("-n", self.bridge, "link", "set", port, "up")
        else:
            _ip("-n", self.hosts[0].namespace, "link", "add", DEVICE, "type", "dummy")
        for h in self.hosts:
            _ip("-n", h.namespace, "addr", "add", f"{h.address}/24", "dev", DEVICE)
            _ip("-n", h.namespace, "link", "set", DEVICE, "up")
            self._shape(h)
        self._wait_for_carrier()
        self.workdir = tempfile.mkdtemp(prefix=self.tag)
        cases = "\n".join(f'  {h.address}|{h.hostname}) ns={h.namespace}; name={h.hostname};;'
                          for h in self.hosts)
        self.launcher = os.path.join(self.workdir, "launch-on-host")
        with open(self.launcher, "w") as f:
            f.write(_LAUNCHER.format(cases=cases))
        os.chmod(self.launcher, 0o755)

    def _wait_for_carrier(self, timeout=10.0):
        # a veth reports its carrier a moment after both ends are up; UCX started before
        # that finds no usable 'eth0' and MPI_Init fails ("Destination is unreachable")
        deadline = time.monotonic() + timeout
        for h in self.hosts:
            while "LOWER_UP" not in _ip("-n", h.namespace, "-o", "link", "show", "dev", DEVICE).stdout:
                if time.monotonic() > deadline:
                    raise TestBedError(f"{h.hostname}: {DEVICE} has no carrier after {timeout:.0f} s")
                time.sleep(0.02)

    def _shape(self, host):
        if not (self.rate or self.delay):
            return
        tc = ["ip", "netns", "exec", host.namespace, "tc", "qdisc", "add", "dev", DEVICE]
        parent = ["root"]
        if self.delay:
            out = subprocess.run(tc + ["root", "handle", "1:", "netem", "delay", self.delay],
                                 capture_output=True, text=True)
            if out.returncode != 0:
                raise TestBedError(f"delay {self.delay}: this kernel has no netem qdisc "
                                   f"(tc: {out.stderr.strip()}); shape bandwidth only (--rate)")
            parent = ["parent", "1:1"]
        if self.rate:
            out = subprocess.run(tc + parent + ["tbf", "rate", self.rate, "burst", self.burst or _burst(self.rate),
                                                "latency", "100ms"], capture_output=True, text=True)
            if out.returncode != 0:
                raise TestBedError(f"rate {self.rate}: tc tbf refused it: {out.stderr.strip()}")

    def close(self):
        """End every process started on the hosts and delete everything made; idempotent."""
        for proc in self.processes:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
        self.processes = []
        for name in reversed(self.namespaces):
            _delete_namespace(name)
        self.namespaces = []
        if self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None

    def __enter__(self):
        self.start()
        # a test run or a benchmark ended by a signal still removes what it made
        for signum in (signal.SIGTERM, signal.SIGHUP):
            try:
                self._previous[signum] = signal.signal(signum, self._on_signal)
            except ValueError:       # not the main thread
                pass
        return self

    def __exit__(self, *exc):
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}
        self.close()
        return False

    def _on_signal(self, signum, frame):
        raise SystemExit(128 + signum)

    # -- running ----------------------------------------------------------------
    def on_host(self, index, argv):
        """argv that runs `argv` on host `index` (its namespace and hostname)."""
        h = self.hosts[index]
        return ["ip", "netns", "exec", h.namespace, "unshare", "--uts", "--",
                "sh", "-c", 'hostname "$0" && exec "$@"', h.hostname, *argv]

    def mpiexec(self, argv, ranks_per_host=1, mpi_args=()):
        """argv that runs `argv` as ranks_per_host ranks on every host (hydra, from host 0)."""
        n = ranks_per_host * len(self.hosts)
        hosts = ",".join(h.address for h in self.hosts)
        return self.on_host(0, [_venv_mpiexec(), "-launcher", "rsh", "-launcher-exec", self.launcher,
                                "-hosts", hosts, "-ppn", str(ranks_per_host), "-n", str(n),
                                "-localhost", self.hosts[0].address, *mpi_args, *argv])

    def environment(self, env=None):
        """The launcher's environment (hydra passes it to every rank): UCX over TCP on eth0."""
        full = dict(os.environ)
        full.update(UCX_TLS="tcp,self", UCX_NET_DEVICES=DEVICE)
        full.update(env or {})
        return full

    def popen(self, argv, ranks_per_host=1, env=None, mpi_args=(), **kw):
        """Start `argv` across the hosts; the process is hydra's mpiexec (own session)."""
        kw.setdefault("start_new_session", True)
        proc = subprocess.Popen(self.mpiexec(argv, ranks_per_host, mpi_args), env=self.environment(env),
                                **kw)
        self.processes.append(proc)
        return proc

    def run(self, argv, ranks_per_host=1, env=None, timeout=None, mpi_args=(), **kw):
        """Run `argv` across the hosts to the end; a CompletedProcess (text output captured
        unless told otherwise)."""
        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("stderr", subprocess.PIPE)
        kw.setdefault("text", True)
        proc = self.popen(argv, ranks_per_host, env, mpi_args, **kw)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(proc.args, timeout, out, err)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def pids_on(self, index):
        """Pids of the processes running on host `index`."""
        return [int(p) for p in _ip("netns", "pids", self.hosts[index].namespace).stdout.split()]


def _burst(rate):
    """tbf's bucket: 2 ms at the rate, at least 64 KB (a veth passes 64 KB GSO packets)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)(bit|bps)", rate.strip().lower())
    if not m:
        raise TestBedError(f"rate: expected a tc rate such as 500mbit or 1gbit, got '{rate}'")
    value = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]
    bytes_per_s = value / 8 if m.group(3) == "bit" else value
    return str(max(64 * 1024, int(bytes_per_s * 2e-3)))


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m tests.multihost.testbed",
        description="Run a command as MPI ranks across emulated hosts (network namespaces joined by "
                    "veth links; root needed), then remove them.",
        epilog="example: python -m tests.multihost.testbed --hosts 2 --rate 500mbit -- "
               "caffepy train --solver solver.prototxt")
    parser.add_argument("--hosts", type=int, default=2, help="emulated hosts (default 2)")
    parser.add_argument("--ranks-per-host", type=int, default=1, help="MPI ranks on each host (default 1)")
    parser.add_argument("--rate", help="each host's outgoing bandwidth, as tc says it (500mbit, 1gbit)")
    parser.add_argument("--delay", help="one-way delay added to each host's packets (needs netem)")
    parser.add_argument("--check", action="store_true", help="only say whether emulated hosts work here")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command each rank runs")
    args = parser.parse_args(argv)
    reason = unavailable()
    if args.check:
        print(f"testbed: {reason}" if reason else "testbed: emulated hosts work here")
        return 1 if reason else 0
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    if reason:
        print(f"testbed: {reason}", file=sys.stderr)
        return 1
    try:
        with TestBed(args.hosts, rate=args.rate, delay=args.delay) as bed:
            hosts = ", ".join(f"{h.hostname}={h.address}" for h in bed.hosts)
            print(f"testbed: {len(bed.hosts)} hosts ({hosts}), rate {args.rate or 'unshaped'}",
                  file=sys.stderr, flush=True)
            proc = bed.popen(command, args.ranks_per_host)
            # the launcher runs in its own session: pass on what a terminal or a job system
            # sends; SIGHUP as SIGUSR1, which hydra forwards (it dies of SIGHUP) and caffepy
            # ranks take as SIGHUP
            def forward(signum, frame):
                proc.send_signal(signal.SIGUSR1 if signum == signal.SIGHUP else signum)
            for signum in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
                signal.signal(signum, forward)
            return proc.wait()
    except TestBedError as e:
        print(f"testbed: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
