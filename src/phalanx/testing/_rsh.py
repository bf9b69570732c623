"""The ssh stand-in of :func:`phalanx.testing.simulated_hosts`: ``RSH [ssh options] HOST COMMAND...``.

Run as a script (``python -I _rsh.py CONFIG ARGS...``, through the small
wrapper that ``simulated_hosts`` writes as ``hosts.rsh``); it imports only the
standard library, so it starts fast and never depends on phalanx being
importable. It behaves as ``ssh`` does where a launcher can tell:

- ssh-style options before the host name are accepted and skipped (``-x``,
  ``-q``, ``-T``, ``-o Opt=val``, ``-p 22``, ``-l user``, ``user@host``, ...);
  ``-n`` gives the command an empty stdin; ``-o ConnectTimeout=S`` is honoured.
- The remaining words are joined by spaces and run by ``sh -c`` on the host, in
  a new session, from ``HOME``, with the environment sshd gives (``PATH``,
  ``HOME``, ``USER``, ``LOGNAME``, ``SHELL``, ``LANG``) plus that host's
  ``TMPDIR``: nothing else of the caller's environment.
- stdin, stdout and stderr are relayed: when the caller closes stdin, or this
  process dies, the command sees EOF on its stdin (and a broken pipe on write),
  as it would when an ssh connection goes away. An EOF while either link is cut
  reaches the command when the link heals, or after ``CUT_NOTICE_S``.
- An unknown host exits 255 at once; when the link of the target host or of
  the host this runs on is cut, it exits 255 after the connect timeout, both
  with ssh's message. The exit status is the
  command's own, or 255 when a signal ended it.
- Signalled (SIGTERM, SIGHUP, SIGINT) while either link is cut, it exits 255 at
  once but the command does not see it go for ``CUT_NOTICE_S`` seconds (or
  until it ends), as the far end of a real ssh connection hears nothing of a
  client that dies behind a partition: a launcher that gives up on a cut host
  cannot end that host's processes through its ssh streams, only they can.
"""

from __future__ import annotations

import functools
import json
import os
import pwd
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable

SSH_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # what sshd gives (Debian)
_WITH_VALUE = set("BbcDEeFIiJLlmOopQRSWw")  # ssh options that take an argument
_DEFAULT_CONNECT_TIMEOUT = 10.0
CUT_NOTICE_S = 5.0  # how long the far side of a connection cut by a partition keeps it open after we die
_CONNECTION: dict[str, object] = {}  # the running command: "target", "hosts", "pid" (for the signal handler)


def parse(args: list[str]) -> tuple[dict[str, str], str, list[str]]:
    """(options, host, command words) of an ssh command line; options keyed by letter ('o' joined by ';')."""
    opts: dict[str, str] = {}
    i = 0
    while i < len(args) and args[i].startswith("-") and args[i] != "-":
        arg = args[i]
        i += 1
        if arg == "--":
            break
        j = 1
        while j < len(arg):
            letter = arg[j]
            if letter in _WITH_VALUE:
                value = arg[j + 1:]
                if not value and i < len(args):
                    value = args[i]
                    i += 1
                opts[letter] = f"{opts[letter]};{value}" if letter == "o" and "o" in opts else value
                break
            opts[letter] = ""
            j += 1
    if i >= len(args):
        return opts, "", []
    host = args[i].rpartition("@")[2]
    return opts, host, args[i + 1:]


def _connect_timeout(opts: dict[str, str]) -> float:
    for setting in opts.get("o", "").split(";"):
        key, _, value = setting.replace("=", " ", 1).partition(" ")
        if key.strip().lower() == "connecttimeout":
            try:
                return float(value)
            except ValueError:
                pass
    return _DEFAULT_CONNECT_TIMEOUT


def _pump(src: int, dst: int, close_dst: bool, hold: Callable[[], None] | None = None) -> None:
    """Copy ``src`` to ``dst`` until EOF or a broken pipe, then (after ``hold()``, if given) close what
    this copy owns."""
    try:
        while True:
            data = os.read(src, 65536)
            if not data:
                break
            view = memoryview(data)
            while view:
                view = view[os.write(dst, view):]
    except OSError:
        pass
    finally:
        os.close(src)
        if close_dst:
            if hold is not None:
                hold()
            os.close(dst)


def _hold_while_cut(target: dict[str, str], hosts: list[dict[str, str]]) -> None:
    """An EOF sent while a link is cut is in flight: the far end sees it once the link heals, or when
    it gives the connection up (``CUT_NOTICE_S``), as ssh's channel close would."""
    deadline = time.monotonic() + CUT_NOTICE_S
    while _unreachable(target, hosts) and time.monotonic() < deadline:
        time.sleep(0.1)


def _environment(entry: dict[str, str]) -> dict[str, str]:
    """What sshd sets (the account's home and name from the password database, not the caller's variables),
    ``LANG`` as ssh forwards it by default (``SendEnv LANG``), and the host's ``TMPDIR``."""
    try:
        account = pwd.getpwuid(os.getuid())
        home, user = account.pw_dir, account.pw_name
    except KeyError:
        home, user = "/", str(os.getuid())
    env = {"PATH": SSH_PATH, "HOME": home, "USER": user, "LOGNAME": user, "SHELL": "/bin/sh",
           "TMPDIR": entry["tmpdir"]}
    if "LANG" in os.environ:
        env["LANG"] = os.environ["LANG"]
    return env


def _unreachable(target: dict[str, str], hosts: Iterable[dict[str, str]]) -> bool:
    """Whether the link of the target host, or of the simulated host this runs on, is cut (a host
    reaches itself regardless, as its own address is local)."""
    try:
        here = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        here = None
    if here == target["net"]:
        return False
    source = next((h for h in hosts if h["net"] == here), None)
    return any(os.path.exists(h["cut_marker"]) for h in (target, source) if h is not None)


def run(config: dict[str, object], args: list[str]) -> int:
    """Run one ssh-style command line on its simulated host; returns the exit status ssh would."""
    opts, host, words = parse(args)
    hosts: dict[str, dict[str, str]] = config["hosts"]  # type: ignore[assignment]
    if not host:
        print("usage: RSH [ssh options] HOST COMMAND...", file=sys.stderr)
        return 255
    entry = hosts.get(host)
    if entry is None:
        print(f"ssh: Could not resolve hostname {host}: Name or service not known", file=sys.stderr)
        return 255
    if not words:
        print(f"ssh: {host}: this stand-in runs commands only (no login shell); give a command", file=sys.stderr)
        return 255
    if _unreachable(entry, hosts.values()):
        time.sleep(_connect_timeout(opts))
        print(f"ssh: connect to host {host} port 22: Connection timed out", file=sys.stderr)
        return 255
    env = _environment(entry)
    home = env["HOME"] if os.path.isdir(env["HOME"]) else "/"
    cmd = ["nsenter", "-t", str(entry["pid"]), "--net", "--uts", "--ipc", "--mount", f"--wd={home}", "--",
           "/bin/sh", "-c", " ".join(words)]
    stdin = subprocess.DEVNULL if "n" in opts else subprocess.PIPE
    proc = subprocess.Popen(cmd, env=env, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    _CONNECTION.update(target=entry, hosts=list(hosts.values()), pid=proc.pid)
    if proc.stdin is not None:  # never joined: it may wait on our stdin after the command ended
        hold = functools.partial(_hold_while_cut, entry, list(hosts.values()))
        threading.Thread(target=_pump, args=(0, os.dup(proc.stdin.fileno()), True, hold), daemon=True).start()
        proc.stdin.close()
    assert proc.stdout is not None and proc.stderr is not None
    outs = [threading.Thread(target=_pump, args=(os.dup(p.fileno()), fd, False), daemon=True)
            for p, fd in ((proc.stdout, 1), (proc.stderr, 2))]
    proc.stdout.close()
    proc.stderr.close()
    for thread in outs:
        thread.start()
    status = proc.wait()
    for thread in outs:
        thread.join()
    return status if status >= 0 else 255


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _hang_up(signum: int, frame: object) -> None:
    """Like ssh: go at once. The pipes close behind us, unless a partition cuts the connection: then a
    detached child keeps them open for ``CUT_NOTICE_S`` (or until the command ends), the time the far end
    would take to notice."""
    target, hosts, pid = (_CONNECTION.get(k) for k in ("target", "hosts", "pid"))
    if target is not None and _unreachable(target, hosts) and os.fork() == 0:  # type: ignore[arg-type]
        os.setsid()
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        deadline = time.monotonic() + CUT_NOTICE_S
        while time.monotonic() < deadline and _alive(pid):  # type: ignore[arg-type]
            time.sleep(0.1)
    os._exit(255)


def main() -> None:
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, _hang_up)
    with open(sys.argv[1]) as f:
        config = json.load(f)
    status = run(config, sys.argv[2:])
    sys.stdout.flush()
    os._exit(status)  # not sys.exit: the stdin relay may still be blocked reading


if __name__ == "__main__":
    main()
