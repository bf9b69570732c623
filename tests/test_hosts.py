"""Simulated hosts (``phalanx.testing.simulated_hosts``): isolation, the ssh stand-in, MPI across hosts, faults.

One instance of three hosts serves the checks that leave it as they found it
(each its own test); the checks of creation and removal build their own. Every
test runs real processes in real namespaces and needs root: elsewhere it is
skipped with the reason (``requires_hosts``), except the argument checks.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import pytest

from helpers import requires_hosts
from phalanx import InvalidArgumentError, SimulatedHostsUnavailableError
from phalanx.testing import SimulatedHosts, simulated_hosts
from phalanx.testing._netns import processes_in

K = 3
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
RUN = {"capture_output": True, "text": True, "timeout": 30}

# A TCP sink on port 5001: reads a length, then that many bytes, then answers b"k".
SINK = textwrap.dedent("""
    import socket
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", 5001)); s.listen(8); print("listening", flush=True)
    while True:
        c, _ = s.accept()
        n = int.from_bytes(c.recv(8, socket.MSG_WAITALL), "big")
        while n > 0:
            d = c.recv(1 << 20)
            if not d:
                break
            n -= len(d)
        c.sendall(b"k"); c.close()
""")
# Sends argv[2] bytes to argv[1]:5001 and prints the seconds until the sink confirmed them all.
SEND = textwrap.dedent("""
    import socket, sys, time
    n = int(sys.argv[2]); start = time.monotonic()
    c = socket.create_connection((sys.argv[1], 5001), timeout=float(sys.argv[3]))
    c.sendall(n.to_bytes(8, "big") + b"x" * n)
    assert c.recv(1) == b"k"
    print(time.monotonic() - start)
""")


@pytest.fixture(scope="module")
def hosts() -> Iterator[SimulatedHosts]:
    with simulated_hosts(K) as made:
        yield made


@pytest.fixture(scope="module")
def sink(hosts: SimulatedHosts) -> Iterator[str]:
    """A TCP sink on host 1, for the rate and cut checks; yields its host name."""
    proc = hosts.popen(1, [sys.executable, "-c", SINK], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "listening"
    yield "h1"
    proc.kill()
    proc.wait(5)


def send(hosts: SimulatedHosts, target: str, nbytes: int, timeout: float = 20.0) -> float:
    """Seconds for host 0 to send ``nbytes`` over TCP to ``target``'s sink (raises when it cannot)."""
    done = hosts.run(0, [sys.executable, "-c", SEND, target, str(nbytes), str(timeout)], check=True,
                     capture_output=True, text=True, timeout=timeout + 10)
    return float(done.stdout)


def on(hosts: SimulatedHosts, i: int, script: str) -> str:
    """stdout of ``sh -c script`` on host ``i`` (which must succeed)."""
    return hosts.run(i, script, shell=True, check=True, **RUN).stdout


# -- what a host is ------------------------------------------------------------------------------

@requires_hosts
def test_each_host_has_its_own_host_name(hosts: SimulatedHosts) -> None:
    assert [on(hosts, i, "hostname").strip() for i in range(K)] == hosts.names == ["h0", "h1", "h2"]


@requires_hosts
def test_each_host_has_one_address_on_eth0_and_no_route_out(hosts: SimulatedHosts) -> None:
    for i in range(K):
        assert f"inet {hosts.addresses[i]}/24" in on(hosts, i, f"ip -4 addr show dev {hosts.iface}")
        assert "default" not in on(hosts, i, "ip route")
    assert hosts.addresses == ["198.18.0.1", "198.18.0.2", "198.18.0.3"]


@requires_hosts
def test_dev_shm_is_private_to_each_host(hosts: SimulatedHosts) -> None:
    for i in range(K):
        on(hosts, i, f"echo {i} > /dev/shm/phalanx-mark")
    assert [on(hosts, i, "ls /dev/shm").split() for i in range(K)] == [["phalanx-mark"]] * K
    assert [on(hosts, i, "cat /dev/shm/phalanx-mark").strip() for i in range(K)] == ["0", "1", "2"]
    assert not os.path.exists("/dev/shm/phalanx-mark")  # nor on the machine itself


@requires_hosts
def test_every_host_resolves_every_host_name_to_its_address(hosts: SimulatedHosts) -> None:
    code = "import socket; print(*[socket.gethostbyname(f'h{i}') for i in range(3)])"
    for i in range(K):
        assert hosts.run(i, [sys.executable, "-c", code], check=True, **RUN).stdout.split() == hosts.addresses


@requires_hosts
def test_each_host_has_its_own_tmpdir(hosts: SimulatedHosts) -> None:
    seen = [on(hosts, i, 'echo "$TMPDIR"; test -d "$TMPDIR" && test -w "$TMPDIR"').strip() for i in range(K)]
    assert seen == [hosts.tmpdir(i) for i in range(K)] and len(set(seen)) == K


@requires_hosts
def test_run_returns_like_subprocess_run(hosts: SimulatedHosts, tmp_path) -> None:
    done = hosts.run(2, ["sh", "-c", "pwd; echo $0 $FOO >&2; exit 3", "x"], cwd=tmp_path,
                     env={"PATH": os.environ["PATH"], "FOO": "bar"}, **RUN)
    assert (done.returncode, done.stdout.strip(), done.stderr.strip()) == (3, str(tmp_path), "x bar")


@requires_hosts
def test_popen_runs_on_the_host_and_pipes_its_streams(hosts: SimulatedHosts) -> None:
    proc = hosts.popen(1, "hostname; cat", shell=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate("from stdin\n", timeout=10)
    assert (proc.returncode, out) == (0, "h1\nfrom stdin\n")


@requires_hosts
def test_a_bad_host_number_is_refused(hosts: SimulatedHosts) -> None:
    with pytest.raises(InvalidArgumentError, match=r"run\(3\).*numbered 0 to 2"):
        hosts.run(3, ["true"])


# -- the ssh stand-in ------------------------------------------------------------------------------

@requires_hosts
def test_rsh_joins_the_words_and_runs_them_with_sh_like_ssh(hosts: SimulatedHosts) -> None:
    quoted = subprocess.run([hosts.rsh, "h1", "printf", "'[%s]'", "'a b'"], **RUN)
    unquoted = subprocess.run([hosts.rsh, "h1", "printf", "[%s]", "a b"], **RUN)
    assert (quoted.stdout, unquoted.stdout) == ("[a b]", "[a][b]")  # ssh loses the argv boundaries too


@requires_hosts
def test_rsh_gives_the_minimal_environment_of_ssh(hosts: SimulatedHosts) -> None:
    env = dict(os.environ, PHALANX_CALLER_ONLY="1")
    done = subprocess.run([hosts.rsh, "h2", "hostname; pwd; env"], env=env, check=True, **RUN)
    name, cwd, *lines = done.stdout.splitlines()
    seen = dict(line.split("=", 1) for line in lines)
    assert (name, cwd) == ("h2", pwd.getpwuid(os.getuid()).pw_dir)
    assert set(seen) <= {"PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "TMPDIR", "PWD", "SHLVL", "_"}
    assert seen["TMPDIR"] == hosts.tmpdir(2) and os.path.dirname(sys.executable) not in seen["PATH"]


@requires_hosts
def test_rsh_skips_ssh_options_and_knows_hosts_by_name_and_address(hosts: SimulatedHosts) -> None:
    opts = ["-x", "-q", "-T", "-o", "BatchMode=yes", "-oStrictHostKeyChecking=no", "-p", "22", "-l", "root"]
    assert subprocess.run([hosts.rsh, *opts, "root@h2", "hostname"], **RUN).stdout == "h2\n"
    assert subprocess.run([hosts.rsh, "-x", hosts.addresses[1], "hostname"], **RUN).stdout == "h1\n"
    unknown = subprocess.run([hosts.rsh, "h9", "true"], **RUN)
    assert unknown.returncode == 255 and "Could not resolve hostname h9" in unknown.stderr


@requires_hosts
def test_rsh_passes_the_exit_status_through(hosts: SimulatedHosts) -> None:
    assert subprocess.run([hosts.rsh, "h0", "exit", "7"], **RUN).returncode == 7


@requires_hosts
@pytest.mark.parametrize("end", ["caller-closes-stdin", "stand-in-killed"])
def test_rsh_command_sees_eof_on_stdin_when_the_connection_ends(hosts: SimulatedHosts, end: str) -> None:
    mark = os.path.join(hosts.tmpdir(1), f"eof-{end}")
    proc = subprocess.Popen([hosts.rsh, "h1", f"cat >/dev/null; echo eof > {mark}"], stdin=subprocess.PIPE)
    assert proc.stdin is not None
    proc.stdin.write(b"data\n")
    proc.stdin.flush()
    time.sleep(0.2)
    assert not os.path.exists(mark)  # still reading
    proc.stdin.close() if end == "caller-closes-stdin" else proc.kill()
    deadline = time.monotonic() + 5
    while not os.path.exists(mark) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert os.path.exists(mark), "the command on h1 never saw EOF"
    assert proc.wait(5) == (0 if end == "caller-closes-stdin" else -signal.SIGKILL)


@requires_hosts
def test_rsh_an_eof_sent_across_a_cut_reaches_the_command_when_the_link_heals(hosts: SimulatedHosts) -> None:
    """As ssh's channel close: in flight while the link is down (a launcher closing a cut host's stdin
    cannot end its ranks at once), delivered on the heal (or after CUT_NOTICE_S, when the far end
    gives the connection up)."""
    mark = os.path.join(hosts.tmpdir(1), "eof-cut")
    proc = subprocess.Popen([hosts.rsh, "h1", f"cat >/dev/null; echo eof > {mark}"], stdin=subprocess.PIPE)
    assert proc.stdin is not None
    proc.stdin.write(b"data\n")
    proc.stdin.flush()
    time.sleep(0.3)  # connected before the cut
    hosts.cut(1)
    try:
        proc.stdin.close()
        time.sleep(1.5)
        assert not os.path.exists(mark), "the EOF crossed the cut"
    finally:
        hosts.heal(1)
    deadline = time.monotonic() + 3
    while not os.path.exists(mark) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert os.path.exists(mark), "the command on h1 never saw EOF after the heal"
    assert proc.wait(5) == 0


# -- MPI across hosts ------------------------------------------------------------------------------

ALLREDUCE = ("from mpi4py import MPI; import numpy as np, socket; c = MPI.COMM_WORLD; a = np.ones(1 << 20); "
             "b = np.empty_like(a); c.Allreduce(a, b); names = c.gather(socket.gethostname()); "
             "c.rank == 0 and print(*names, b[0], b[-1], flush=True)")  # 8 MiB; one line, from rank 0


@requires_hosts
def test_mpich_job_across_two_hosts_moves_its_data_over_the_network(hosts: SimulatedHosts) -> None:
    pytest.importorskip("mpi4py")
    if not os.path.exists(MPIEXEC):
        pytest.skip(f"needs MPICH's mpiexec next to the interpreter ({MPIEXEC})")
    tx = "cat /sys/class/net/eth0/statistics/tx_bytes"
    before = int(on(hosts, 1, tx))
    done = hosts.run(0, [MPIEXEC, "-launcher", "ssh", "-launcher-exec", hosts.rsh, "-hosts", "h0:1,h1:1",
                         sys.executable, "-c", ALLREDUCE], **{**RUN, "timeout": 60})
    sent = int(on(hosts, 1, tx)) - before
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout == "h0 h1 2.0 2.0\n"
    assert sent >= 8 << 20, f"h1 sent {sent} bytes on eth0 for an allreduce of 8 MiB: shared memory, not network"


OMPI = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".venv-ompi", "bin")


@requires_hosts
def test_open_mpi_job_across_two_hosts_starts_through_the_rsh_agent(hosts: SimulatedHosts) -> None:
    if not os.path.exists(os.path.join(OMPI, "mpiexec")) or not os.path.exists(os.path.join(OMPI, "python")):
        pytest.skip(f"needs an Open MPI environment with mpi4py at {os.path.dirname(OMPI)}")
    tx = "cat /sys/class/net/eth0/statistics/tx_bytes"
    before = int(on(hosts, 1, tx))
    done = hosts.run(0, [os.path.join(OMPI, "mpiexec"), "--allow-run-as-root", "--mca", "plm_rsh_agent", hosts.rsh,
                         "--host", "h0:1,h1:1", "-n", "2", os.path.join(OMPI, "python"), "-c", ALLREDUCE],
                     **{**RUN, "timeout": 60})
    sent = int(on(hosts, 1, tx)) - before
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout == "h0 h1 2.0 2.0\n"
    assert sent >= 8 << 20, f"h1 sent {sent} bytes on eth0 for an allreduce of 8 MiB: shared memory, not network"


# -- faults ----------------------------------------------------------------------------------------

@requires_hosts
def test_set_rate_limits_tcp_throughput_and_none_restores_it(hosts: SimulatedHosts, sink: str) -> None:
    nbytes = 8 << 20
    expected = nbytes * 8 / 100e6  # 0.67 s at 100 Mbit/s
    hosts.set_rate("100mbit")
    try:
        shaped = send(hosts, sink, nbytes)
    finally:
        hosts.set_rate(None)
    free = send(hosts, sink, nbytes)
    assert 0.85 * expected <= shaped <= 1.5 * expected, f"{shaped:.3f} s at 100mbit, expected {expected:.3f} s"
    assert free < 0.3 * expected, f"{free:.3f} s after set_rate(None)"
    assert "tbf" not in on(hosts, 0, "tc qdisc show dev eth0")


@requires_hosts
def test_cut_makes_connections_time_out_and_heal_restores_them(hosts: SimulatedHosts, sink: str) -> None:
    hosts.cut(1)
    try:
        start = time.monotonic()
        with pytest.raises(subprocess.CalledProcessError):
            send(hosts, sink, 1000, timeout=1.0)
        assert time.monotonic() - start < 5
    finally:
        hosts.heal(1)
    assert send(hosts, sink, 1000) < 1.0


@requires_hosts
def test_rsh_to_a_cut_host_fails_like_ssh_after_the_connect_timeout(hosts: SimulatedHosts) -> None:
    hosts.cut(2)
    try:
        start = time.monotonic()
        done = subprocess.run([hosts.rsh, "-o", "ConnectTimeout=1", "h2", "true"], **RUN)
        took = time.monotonic() - start
    finally:
        hosts.heal(2)
    assert done.returncode == 255 and "Connection timed out" in done.stderr and 0.9 < took < 5
    assert subprocess.run([hosts.rsh, "h2", "true"], **RUN).returncode == 0


@requires_hosts
def test_rsh_from_a_cut_host_reaches_only_itself(hosts: SimulatedHosts) -> None:
    hosts.cut(2)
    try:
        out = hosts.run(2, [hosts.rsh, "-o", "ConnectTimeout=0.5", "h0", "true"], **RUN)
        itself = hosts.run(2, [hosts.rsh, "h2", "hostname"], **RUN)
    finally:
        hosts.heal(2)
    assert (out.returncode, itself.stdout) == (255, "h2\n")


@requires_hosts
def test_kill_leaves_no_process_on_the_host(hosts: SimulatedHosts) -> None:
    started = [hosts.popen(2, "sleep 60 & sleep 60 & wait", shell=True), hosts.popen(2, ["sleep", "60"])]
    time.sleep(0.1)
    assert len(hosts.pids(2)) >= 4
    hosts.kill(2)
    assert hosts.pids(2) == [] and [p.wait(5) for p in started] == [-signal.SIGKILL] * 2
    assert on(hosts, 2, "hostname") == "h2\n"  # the host itself stays up


# -- creation and removal --------------------------------------------------------------------------

def leftovers(netns: list[str], inodes: list[int], tmp: str) -> list[str]:
    """What remains of an instance: its namespaces, processes and files."""
    names = subprocess.run(["ip", "netns", "list"], **RUN).stdout
    found = [ns for ns in netns if ns in names]
    found += [f"process {pid}" for inode in inodes for pid in processes_in(inode)]
    return found + [tmp] * os.path.exists(tmp)


def snapshot(hosts: SimulatedHosts) -> tuple[list[str], list[int], str]:
    netns = [hosts.netns(i) for i in range(len(hosts))]
    return netns, [os.stat(f"/run/netns/{ns}").st_ino for ns in netns], os.path.dirname(hosts.rsh)


@requires_hosts
def test_nothing_of_an_instance_remains_after_the_with_block() -> None:
    with simulated_hosts(2, rate="1gbit") as made:
        seen = snapshot(made)
        switch = seen[0][0].rsplit("-", 1)[0] + "-sw"
        proc = made.popen(1, ["sleep", "60"])
    assert leftovers([*seen[0], switch], *seen[1:]) == []
    assert proc.wait(5) == -signal.SIGKILL
    assert "198.18." not in subprocess.run(["ip", "addr"], **RUN).stdout  # nothing in this namespace either


@requires_hosts
def test_cleanup_also_happens_when_the_body_raises() -> None:
    with pytest.raises(RuntimeError, match="body failed"), simulated_hosts(1) as made:
        seen = snapshot(made)
        proc = made.popen(0, ["sleep", "60"])
        raise RuntimeError("body failed")
    assert leftovers(*seen) == [] and proc.wait(5) == -signal.SIGKILL


HOLD = textwrap.dedent("""
    import time
    from phalanx.testing import simulated_hosts
    with simulated_hosts(2) as hosts:
        hosts.popen(1, ["sleep", "60"])
        print(hosts.netns(0), hosts.netns(1), hosts.rsh, flush=True)
        time.sleep(60)
""")


@requires_hosts
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm-cleans-up", "sigkill-next-cleans"])
def test_an_interrupted_owner_leaves_nothing_behind(sig: int) -> None:
    owner = subprocess.Popen([sys.executable, "-c", HOLD], stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None
    *netns, rsh = owner.stdout.readline().split()
    inodes = [os.stat(f"/run/netns/{ns}").st_ino for ns in netns]
    owner.send_signal(sig)
    owner.wait(10)
    if sig == signal.SIGKILL:  # no code ran in the owner: the next instance removes what it left
        assert leftovers(netns, inodes, os.path.dirname(rsh)) != []
        with simulated_hosts(1):
            pass
    assert leftovers(netns, inodes, os.path.dirname(rsh)) == []


@requires_hosts
def test_setup_and_teardown_of_four_hosts_take_under_two_seconds() -> None:
    start = time.monotonic()
    with simulated_hosts(4) as made:
        built = time.monotonic()
        assert made.run(3, ["hostname"], **RUN).stdout == "h3\n"
        ready = time.monotonic()
    assert (built - start) + (time.monotonic() - ready) < 2.0


# -- arguments and availability ---------------------------------------------------------------------

@pytest.mark.parametrize("k", [0, -1, 2.0, True, 251])
def test_a_bad_number_of_hosts_is_refused(k: object) -> None:
    with pytest.raises(InvalidArgumentError, match=r"simulated_hosts\(k=.*int from 1 to 250"):
        simulated_hosts(k)  # type: ignore[arg-type]


@pytest.mark.parametrize("rate", ["fast", "100", "-5mbit", "1 Mb"])
def test_a_bad_rate_is_refused(rate: str) -> None:
    with pytest.raises(InvalidArgumentError, match="not a link rate.*'100mbit'"):
        simulated_hosts(2, rate=rate)


def test_without_root_entering_raises_with_the_reason() -> None:
    if os.geteuid() != 0:
        with pytest.raises(SimulatedHostsUnavailableError, match="need root"):
            simulated_hosts(1).__enter__()
        return
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv to try as another user")
    code = ("from phalanx.testing import simulated_hosts\n"
            "try:\n    simulated_hosts(1).__enter__()\nexcept Exception as e:\n    print(type(e).__name__, e)")
    done = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c",
                           code], cwd="/", **RUN)
    assert done.stdout.startswith("SimulatedHostsUnavailableError") and "need root" in done.stdout, done.stderr
