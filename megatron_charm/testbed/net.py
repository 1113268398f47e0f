"""Thin wrappers over ``ip`` and ``tc`` (iproute2): namespaces, veth links, tbf shaping."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

from megatron_charm.testbed.config import NAME_PREFIX

#: Seconds any single ip/tc call may take; they normally return in milliseconds.
CMD_TIMEOUT_S = 20.0


#: MTU of cross-node links. tbf counts whole frames, so headers eat 4.4% of the rate at 1500 and
#: 0.7% at 9000; jumbo frames are also what datacenter fabrics use.
CROSS_MTU = 9000


class TestbedError(RuntimeError):
    """A testbed operation failed (missing tool, no privileges, ip/tc error, rank failure)."""

    __test__ = False


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run one command, raising ``TestbedError`` with its stderr when it fails."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=CMD_TIMEOUT_S)
    except FileNotFoundError as exc:
        raise TestbedError(
            f"{argv[0]!r} not found; run scripts/testbed/setup.sh (installs iproute2)"
        ) from exc
    except subprocess.TimeoutExpired as exc:
        raise TestbedError(f"{' '.join(argv)} did not finish in {CMD_TIMEOUT_S} s") from exc
    if check and proc.returncode != 0:
        raise TestbedError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def check_prerequisites() -> None:
    """Raise ``TestbedError`` saying what is missing: root, ``ip``, ``tc``, usable netns."""
    if os.geteuid() != 0:
        raise TestbedError("the testbed needs root (network namespaces and tc); run it as root")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise TestbedError(f"{tool!r} not found; run scripts/testbed/setup.sh")
    probe = f"{NAME_PREFIX}probe{os.getpid()}"
    proc = sh("ip", "netns", "add", probe, check=False)
    if proc.returncode != 0:
        raise TestbedError(f"'ip netns add' does not work here: {proc.stderr.strip()}")
    sh("ip", "netns", "delete", probe, check=False)


def netem_available() -> bool:
    """Whether the kernel has the netem qdisc (delay/loss emulation); the testbed uses only tbf."""
    probe = f"{NAME_PREFIX}netem{os.getpid()}"
    sh("ip", "netns", "add", probe)
    try:
        sh("ip", "-n", probe, "link", "set", "lo", "up")
        proc = sh(
            "tc",
            "-n",
            probe,
            "qdisc",
            "add",
            "dev",
            "lo",
            "root",
            "netem",
            "delay",
            "1ms",
            check=False,
        )
        return proc.returncode == 0
    finally:
        sh("ip", "netns", "delete", probe, check=False)


def list_namespaces(prefix: str = NAME_PREFIX) -> list[str]:
    """Names of existing namespaces that start with ``prefix`` (plus orphaned hosts folders)."""
    proc = sh("ip", "netns", "list", check=False)
    names = {line.split()[0] for line in proc.stdout.splitlines() if line.strip()}
    if os.path.isdir(ETC_NETNS):
        names |= set(os.listdir(ETC_NETNS))
    return sorted(n for n in names if n.startswith(prefix))


def add_namespace(ns: str) -> None:
    sh("ip", "netns", "add", ns)
    sh("ip", "-n", ns, "link", "set", "lo", "up")


def delete_namespace(ns: str) -> bool:
    """Delete ``ns`` (its veth ends go with it) and its hosts file. Returns whether it existed."""
    remove_hosts(ns)
    return sh("ip", "netns", "delete", ns, check=False).returncode == 0


#: ``ip netns exec NS`` bind-mounts files of ``/etc/netns/NS/`` over ``/etc/`` for the command.
ETC_NETNS = "/etc/netns"


def write_hosts(ns: str, names: dict[str, str]) -> None:
    """Give ``ns`` an ``/etc/hosts``: the host's own plus ``address name`` for every rank.

    Without it, c10d's reverse lookups of peer addresses go to DNS, fail (nothing is reachable
    from the namespaces) and print a warning per connection.
    """
    try:
        with open("/etc/hosts") as f:
            base = f.read()
    except OSError:
        base = "127.0.0.1 localhost\n"
    os.makedirs(os.path.join(ETC_NETNS, ns), exist_ok=True)
    with open(os.path.join(ETC_NETNS, ns, "hosts"), "w") as f:
        f.write(base.rstrip("\n") + "\n# megatron-charm testbed ranks\n")
        # Dual-stack listeners (the c10d store) see peers as IPv4-mapped IPv6 addresses.
        f.writelines(f"{addr} {name}\n::ffff:{addr} {name}\n" for addr, name in names.items())


def remove_hosts(ns: str) -> None:
    shutil.rmtree(os.path.join(ETC_NETNS, ns), ignore_errors=True)
    try:
        os.rmdir(ETC_NETNS)  # only if no other namespace uses it
    except OSError:
        pass


def add_rank_interface(ns: str, ifname: str, address: str) -> None:
    """Give a rank its own interface carrying ``address``.

    A veth pair with both ends in the same namespace: the one named ``ifname`` holds the address
    (the peer only keeps it up). Dummy interfaces would do as well, but the dummy module is
    often missing in containers and VMs, veth is always there.
    """
    sh("ip", "-n", ns, "link", "add", ifname, "type", "veth", "peer", "name", ifname + "p")
    sh("ip", "-n", ns, "addr", "add", address + "/32", "dev", ifname)
    sh("ip", "-n", ns, "link", "set", ifname + "p", "up")
    sh("ip", "-n", ns, "link", "set", ifname, "up")


def add_veth(ns_a: str, if_a: str, addr_a: str, ns_b: str, if_b: str, addr_b: str) -> None:
    """A veth pair between two namespaces, each end with a /31 address."""
    sh(
        "ip",
        "link",
        "add",
        if_a,
        "netns",
        ns_a,
        "type",
        "veth",
        "peer",
        "name",
        if_b,
        "netns",
        ns_b,
    )
    for ns, ifname, addr in ((ns_a, if_a, addr_a), (ns_b, if_b, addr_b)):
        sh("ip", "-n", ns, "addr", "add", addr + "/31", "dev", ifname)
        sh("ip", "-n", ns, "link", "set", ifname, "mtu", str(CROSS_MTU))
        sh("ip", "-n", ns, "link", "set", ifname, "up")


def add_route(ns: str, dst: str, gateway: str, dev: str, src: str) -> None:
    sh("ip", "-n", ns, "route", "add", dst, "via", gateway, "dev", dev, "src", src)


def tbf_params(rate_bps: int, mtu: int) -> tuple[int, int]:
    """``(burst, limit)`` in bytes for a tbf at ``rate_bps`` on a device with ``mtu``.

    The burst must hold a full packet (else tbf drops it) and about 2 ms of traffic so that the
    token bucket is not refilled faster than the kernel timers can serve it. The queue holds about
    200 ms of traffic: many gloo connections share one link, and drops in the sender's own qdisc
    make TCP back off far below the configured rate. (Capped at 64 MiB for very fast links.)
    """
    rate_bytes = rate_bps / 8
    burst = max(2 * (mtu + 100), int(rate_bytes * 0.002), 16 * 1024)
    limit = max(4 * burst, min(int(rate_bytes * 0.2), 64 << 20), 1 << 20)
    return burst, limit


#: IP packets up to this many bytes (total length) go ahead of queued data: TCP's pure
#: acknowledgements (52 bytes with timestamps, up to 84 with SACK blocks), not data segments.
SMALL_PACKET_BYTES = 128


def shape(
    ns: str, dev: str, rate_bps: int, delay: str | None = None, ack_priority: bool = True
) -> None:
    """Limit egress of ``dev`` inside ``ns`` to ``rate_bps`` with a token bucket filter.

    ``delay`` adds netem under the tbf (check :func:`netem_available` first). ``ack_priority``
    queues small packets ahead of data (Note [Acknowledgements first]).

    Note [Acknowledgements first]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    A link's two directions are two tbf queues, one at each end. TCP data going one way is
    acknowledged by packets going the other way, so with one FIFO per end the acknowledgements
    of A -> B wait behind B -> A's queued data (up to the queue's 200 ms), and A's sender stalls
    for them. On a 2 x 2 testbed at 100 Mbit/s, 2 MiB sent each way at once took 168-206 ms
    against 168 ms one way, different every time; a real NIC link is full duplex. So the tbf
    dequeues from an HTB of two classes at the link's rate, with small packets (a u32 match on
    the IP length) in the class served first, and the same 2 MiB each way then took 168-171 ms::

        tbf (rate, burst, limit)
         `-- htb 10:  prio 0: 10:10 pfifo  <- TCP/IP packets < SMALL_PACKET_BYTES
                      prio 1: 10:20 bfifo  <- everything else (the tbf's limit in bytes)

    Both classes run at the link's rate, so the HTB only orders; the tbf alone shapes.
    """
    info = json.loads(sh("ip", "-j", "-n", ns, "link", "show", "dev", dev).stdout)
    mtu = int(info[0]["mtu"])
    burst, limit = tbf_params(rate_bps, mtu)
    tc = ("tc", "-n", ns)
    rate = f"{rate_bps}bit"
    sh(*tc, "qdisc", "replace", "dev", dev, "root", "handle", "1:", "tbf", "rate", rate,
       "burst", str(burst), "limit", str(limit))  # fmt: skip
    # parent -> (its queue, or None: the tbf's own; netem's limit in packets when delayed)
    leaves: dict[str, tuple[tuple[str, ...] | None, int]] = {"1:1": (None, 10000)}
    if ack_priority:
        quantum = str(max(mtu + 100, 16 * 1024))
        sh(*tc, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", "htb", "default",
           "20")  # fmt: skip
        for classid, prio in (("10:10", "0"), ("10:20", "1")):
            sh(*tc, "class", "add", "dev", dev, "parent", "10:", "classid", classid, "htb",
               "rate", rate, "ceil", rate, "prio", prio, "quantum", quantum)  # fmt: skip
        sh(*tc, "filter", "add", "dev", dev, "parent", "10:", "protocol", "ip", "prio", "1",
           "u32", "match", "ip", "protocol", "6", "0xff",
           "match", "u16", "0x0000", f"{0xFFFF ^ (SMALL_PACKET_BYTES - 1):#06x}", "at", "2",
           "flowid", "10:10")  # fmt: skip
        leaves = {
            "10:10": (("pfifo", "limit", "10000"), 10000),
            "10:20": (("bfifo", "limit", str(limit)), limit // mtu + 1),
        }
    for parent, (queue, packets) in leaves.items():
        if delay is not None:  # netem delays what the bucket (and the HTB) let through
            sh(*tc, "qdisc", "add", "dev", dev, "parent", parent, "netem", "delay", delay,
               "limit", str(packets))  # fmt: skip
        elif queue is not None:
            sh(*tc, "qdisc", "add", "dev", dev, "parent", parent, *queue)
