"""Host lists (`--hosts`, `--hostfile`) and Slurm allocations, read and checked before a job starts.

Pure parsing: no process is started. Each refusal names the flag, what it received and the fix.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from phalanx import LaunchError
from phalanx.launch._hostlist import (
    Host,
    as_hosts,
    check_hosts,
    format_hosts,
    hosts_from_args,
    parse_hosts,
    placement,
    ranks_for,
    read_hostfile,
)
from phalanx.launch._slurm import allocation, expand_nodelist, expand_tasks_per_node, slurm_hosts
from phalanx.launch._srun_rsh import srun_argv


@pytest.mark.parametrize("spec,hosts", [
    ("h0:2,h1:2", [Host("h0", 2), Host("h1", 2)]),
    ("h0,h1:3", [Host("h0", 1), Host("h1", 3)]),
    (" node-1.example.org:4 , 10.0.0.2 ", [Host("node-1.example.org", 4), Host("10.0.0.2", 1)]),
    ("[fe80::1]:2,[::1]", [Host("[fe80::1]", 2), Host("[::1]", 1)]),
], ids=["slots", "default-one-slot", "spaces-fqdn-address", "ipv6"])
def test_hosts_flag_reads_names_and_slots(spec: str, hosts: list[Host]) -> None:
    assert parse_hosts(spec) == hosts
    assert parse_hosts(format_hosts(hosts)) == hosts


def test_hostfile_reads_open_mpi_mpich_and_bare_lines_with_comments(tmp_path: Path) -> None:
    path = tmp_path / "hosts"
    path.write_text("# the cluster\n\nh0 slots=2\nh1:3   # MPICH's form\n  h2  \nh3 slots=4 max_slots=8\n")
    assert read_hostfile(str(path)) == [Host("h0", 2), Host("h1", 3), Host("h2", 1), Host("h3", 4)]


@pytest.mark.parametrize("spec,words", [
    ("", ["--hosts", "empty host list", "--hosts h0:2,h1:2"]),
    ("h0:2,,h1", ["empty entry", "'h0:2,,h1'"]),
    ("h0:0", ["bad slot count '0'", "1 or more"]),
    ("h0:two", ["bad slot count 'two'"]),
    ("h0:-1", ["bad slot count '-1'"]),
    ("h 0:2", ["'h 0' in --hosts", "is not a host name"]),
], ids=["empty", "empty-entry", "zero-slots", "word-slots", "negative-slots", "space-in-name"])
def test_bad_hosts_flag_is_refused_saying_what_and_how(spec: str, words: list[str]) -> None:
    with pytest.raises(LaunchError) as info:
        parse_hosts(spec)
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize("text,words", [
    ("# nothing\n\n", ["lists no host", "h0 slots=2"]),
    ("h0 slots=x\n", ["bad slot count 'x'", "line 1"]),
    ("h0 slots=2\nh1 colour=blue\n", ["cannot read 'h1 colour=blue'", "line 2", "host slots=N"]),
], ids=["no-host", "bad-slots", "unknown-key"])
def test_bad_hostfile_is_refused_with_its_line(tmp_path: Path, text: str, words: list[str]) -> None:
    path = tmp_path / "hosts"
    path.write_text(text)
    with pytest.raises(LaunchError) as info:
        read_hostfile(str(path))
    assert "--hostfile" in str(info.value)
    for word in words:
        assert word in str(info.value)


def test_missing_hostfile_is_refused(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match=r"--hostfile .*nope: cannot read it"):
        read_hostfile(str(tmp_path / "nope"))


def test_duplicate_and_unknown_hosts_are_refused() -> None:
    with pytest.raises(LaunchError, match=r"--hosts: host 'localhost' is listed more than once .*localhost:3"):
        check_hosts(parse_hosts("localhost:2,127.0.0.1,localhost"), resolve=False)
    with pytest.raises(LaunchError, match=r"unknown host name 'no-such-host\.invalid' \(does not resolve here\)"):
        check_hosts(parse_hosts("localhost,no-such-host.invalid"))
    with pytest.raises(LaunchError, match="empty host list"):
        check_hosts([])
    check_hosts(parse_hosts("localhost:2,127.0.0.1"))  # both resolve


def test_ranks_default_to_the_slots_and_more_need_oversubscribe() -> None:
    hosts = parse_hosts("h0:2,h1:2")
    assert ranks_for(None, hosts) == 4
    assert ranks_for(3, hosts) == 3
    assert ranks_for(6, hosts, oversubscribe=True) == 6
    with pytest.raises(LaunchError) as info:
        ranks_for(5, hosts, flag="--hostfile")
    assert str(info.value) == ("phalanx run -n 5 --hostfile: 5 ranks but only 4 slots (h0:2,h1:2); give -n 4 or "
                               "less, more slots, or --oversubscribe to run more ranks than slots.")
    with pytest.raises(LaunchError, match="at least one rank"):
        ranks_for(0, hosts)


def test_ranks_fill_each_hosts_slots_in_order_then_go_round_again() -> None:
    hosts = parse_hosts("h0:2,h1:1")
    assert placement(3, hosts) == [("h0", 0), ("h0", 1), ("h1", 0)]
    assert placement(2, hosts) == [("h0", 0), ("h0", 1)]
    assert placement(5, hosts) == [("h0", 0), ("h0", 1), ("h1", 0), ("h0", 2), ("h0", 3)]


def test_hosts_and_hostfile_from_the_command_line(tmp_path: Path) -> None:
    path = tmp_path / "hosts"
    path.write_text("localhost slots=2\n")
    assert hosts_from_args(None, None) is None
    assert hosts_from_args("localhost:3", None) == [Host("localhost", 3)]
    assert hosts_from_args(None, str(path)) == [Host("localhost", 2)]
    with pytest.raises(LaunchError, match="got both --hosts 'localhost' and --hostfile"):
        hosts_from_args("localhost", str(path))
    with pytest.raises(LaunchError, match="--hostfile: host 'localhost' is listed more than once"):
        path.write_text("localhost\nlocalhost:2\n")
        hosts_from_args(None, str(path))


def test_launch_fields_take_hosts_as_text_pairs_or_hosts() -> None:
    expected = [Host("h0", 2), Host("h1", 1)]
    assert as_hosts(None) is None
    assert as_hosts("h0:2,h1") == expected
    assert as_hosts([["h0", 2], ["h1", 1]]) == expected  # as JSON gives them back
    assert as_hosts(["h0:2", Host("h1")]) == expected
    assert as_hosts([{"name": "h0", "slots": 2}, {"name": "h1", "slots": 1}]) == expected  # dataclasses.asdict


@pytest.mark.parametrize("nodelist,names", [
    ("node[01-04,07],gpu3", ["node01", "node02", "node03", "node04", "node07", "gpu3"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),
    ("r[1-2]n[1,3]-ib", ["r1n1-ib", "r1n3-ib", "r2n1-ib", "r2n3-ib"]),
    ("single", ["single"]),
    ("a[1],b[009-010]", ["a1", "b009", "b010"]),
], ids=["padded-and-plain", "unpadded", "two-groups", "one", "several"])
def test_slurm_node_lists_expand_to_host_names(nodelist: str, names: list[str]) -> None:
    assert expand_nodelist(nodelist) == names


@pytest.mark.parametrize("bad", ["node[1-", "node[a-b]", "node]1["])
def test_unreadable_slurm_node_list_is_refused(bad: str) -> None:
    with pytest.raises(LaunchError, match="cannot read the Slurm node list"):
        expand_nodelist(bad)


def test_slurm_tasks_per_node_expand() -> None:
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("4") == [4]
    with pytest.raises(LaunchError, match=r"SLURM_TASKS_PER_NODE='2\(3\)'"):
        expand_tasks_per_node("2(3)")


def test_slurm_allocation_from_the_environment() -> None:
    assert allocation({}) is None
    alloc = allocation({"SLURM_JOB_ID": "42", "SLURM_NTASKS": "7", "SLURM_JOB_NODELIST": "node[01-03],gpu3",
                        "SLURM_TASKS_PER_NODE": "2(x3),1"})
    assert alloc is not None and alloc.job_id == "42" and alloc.ntasks == 7
    assert alloc.hosts == [Host("node01", 2), Host("node02", 2), Host("node03", 2), Host("gpu3", 1)]
    bare = allocation({"SLURM_JOB_ID": "43", "SLURM_NODELIST": "n[1-2]"})  # salloc -N 2, no task count
    assert bare is not None and bare.ntasks is None and bare.hosts == [Host("n1"), Host("n2")]
    with pytest.raises(LaunchError, match="SLURM_NTASKS='many'"):
        allocation({"SLURM_JOB_ID": "44", "SLURM_NTASKS": "many"})


def test_slurm_hosts_for_gloo_are_the_allocations_nodes_through_srun() -> None:
    two = {"SLURM_JOB_ID": "45", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "2(x2)"}
    hosts, rsh = slurm_hosts(None, two)
    assert hosts == [Host("n1", 2), Host("n2", 2)]
    assert rsh is not None and rsh.endswith("-m phalanx.launch._srun_rsh")
    assert slurm_hosts("ssh -p 2222", two) == (hosts, "ssh -p 2222")  # a given --rsh is kept
    one = {"SLURM_JOB_ID": "46", "SLURM_JOB_NODELIST": "n1", "SLURM_TASKS_PER_NODE": "4"}
    assert slurm_hosts(None, one) == (None, None)  # one node: the ranks run here, as without Slurm
    assert slurm_hosts(None, {}) == (None, None)  # no allocation
    # the step that runs a per-host launcher: one task on that node, sharing it, stdin handed on
    assert srun_argv("n2", ["cd", "/w", "&&", "exec", "python"], "--cpus-per-task=8") == [
        "srun", "--nodes", "1", "--ntasks", "1", "--nodelist", "n2", "--overlap", "--input", "all",
        "--cpus-per-task=8", "sh", "-c", "cd /w && exec python"]
