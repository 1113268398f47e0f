"""The emulated machine: build, describe, run on and tear down a set of node namespaces."""

from __future__ import annotations

import atexit
import json
import os
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from megatron_charm.constants import DEFAULT_TIMEOUT_S
from megatron_charm.testbed import net
from megatron_charm.testbed.config import (
    NAME_PREFIX,
    PRESET_RATIOS,
    TestbedConfig,
    cross_links,
    namespace,
    parse_rate,
    rank_address,
    rank_ifname,
    routes,
)
from megatron_charm.testbed.launch import RunResult, launch
from megatron_charm.testbed.net import TestbedError

#: Where a testbed records its configuration while it is up (so ``down``/``run`` can find it),
#: unless ``state_dir=`` names another directory (no environment variable changes it).
STATE_DIR = "/run/megatron-charm-testbed"

#: Registry of the testbeds this process brought up, so that SIGTERM/SIGHUP can take them down.
_LIVE: dict[str, Testbed] = {}
_LIVE_LOCK = threading.Lock()
_HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class Testbed:
    """``nodes x ranks_per_node`` ranks in network namespaces joined by tbf-shaped veth links.

    Use it as a context manager; everything is removed on exit, on errors, on Ctrl-C, on SIGTERM
    and SIGHUP, and at interpreter exit::

        with Testbed(nodes=2, ranks_per_node=2, topology="shared", cross_rate="100mbit") as tb:
            tb.run([sys.executable, "train.py"], timeout_s=300).check()

    ``persistent=True`` (the CLI's ``up``) leaves it in place for later ``attach``/``down``.
    ``state_dir`` is where it records its configuration while it is up (default
    :data:`STATE_DIR`); ``attach`` and ``cleanup`` must be given the same directory.
    """

    __test__ = False

    def __init__(
        self,
        config: TestbedConfig | None = None,
        *,
        persistent: bool = False,
        state_dir: str = STATE_DIR,
        **kwargs: Any,
    ) -> None:
        if config is not None and kwargs:
            raise ValueError("pass either a TestbedConfig or keyword settings, not both")
        self.config = config if config is not None else TestbedConfig(**kwargs)
        self.config.validate()
        self.persistent = persistent
        self.state_dir = state_dir
        self.cross_rate_bps: int | None = None
        """Configured rate of each cross link and direction, once built."""
        self.intra_rate_bps: int | None = None
        """Configured intra-node cap, or ``None`` when intra traffic is unshaped."""
        self.measured_intra_bps: float | None = None
        """Intra-node bandwidth measured for a preset (``None`` without a preset)."""
        self._up = False
        self._old_handlers: dict[int, Any] = {}

    # ----------------------------------------------------------------- lifecycle
    @property
    def namespaces(self) -> list[str]:
        return [namespace(self.config.name, n) for n in range(self.config.nodes)]

    @property
    def is_up(self) -> bool:
        return self._up

    def up(self) -> Testbed:
        """Create namespaces, addresses, links, routes and shaping; tear down if any step fails."""
        cfg = self.config
        net.check_prerequisites()
        if cfg.cross_delay is not None and not net.netem_available():
            raise TestbedError(
                f"cross_delay={cfg.cross_delay!r} needs the netem qdisc, which this kernel does "
                "not have (sch_netem); leave cross_delay unset (links are rate-shaped only)"
            )
        existing = net.list_namespaces(f"{NAME_PREFIX}{cfg.name}-")
        if existing:
            raise TestbedError(
                f"testbed {cfg.name!r} already exists ({', '.join(existing)}); run "
                f"'python -m megatron_charm.testbed down --name {cfg.name}' or pick another name"
            )
        with _LIVE_LOCK:
            _LIVE[cfg.name] = self
        self._up = True
        try:
            self._build()
            self._write_state()
        except BaseException:
            self.down()
            raise
        return self

    def _build(self) -> None:
        cfg = self.config
        hosts = {
            rank_address(n, i): f"{namespace(cfg.name, n)}-r{i}"
            for n in range(cfg.nodes)
            for i in range(cfg.ranks_per_node)
        }
        for node, ns in enumerate(self.namespaces):
            net.add_namespace(ns)
            net.write_hosts(ns, hosts)
            for local in range(cfg.ranks_per_node):
                net.add_rank_interface(ns, rank_ifname(local), rank_address(node, local))
        links = cross_links(cfg)
        for link in links:
            net.add_veth(
                namespace(cfg.name, link.a),
                link.ifname(link.a),
                link.address(link.a),
                namespace(cfg.name, link.b),
                link.ifname(link.b),
                link.address(link.b),
            )
        for node, ns in enumerate(self.namespaces):
            for dst, gateway, dev, src in routes(cfg, node):
                net.add_route(ns, dst, gateway, dev, src)
        if cfg.intra_rate is not None:
            self.intra_rate_bps = parse_rate(cfg.intra_rate, "intra_rate")
            for ns in self.namespaces:
                net.shape(ns, "lo", self.intra_rate_bps, ack_priority=cfg.ack_priority)
        if cfg.preset is not None:
            ratio = PRESET_RATIOS[cfg.preset]
            if self.intra_rate_bps is None:
                from megatron_charm.testbed.probe import measure_intra

                self.measured_intra_bps = measure_intra(self)
            intra = self.intra_rate_bps or self.measured_intra_bps
            assert intra is not None
            self.cross_rate_bps = int(intra / ratio)
        else:
            self.cross_rate_bps = parse_rate(cfg.cross_rate, "cross_rate")
        for link in links:
            for node in (link.a, link.b):
                net.shape(
                    namespace(cfg.name, node),
                    link.ifname(node),
                    self.cross_rate_bps,
                    cfg.cross_delay,
                    ack_priority=cfg.ack_priority,
                )

    def down(self) -> None:
        """Remove the namespaces (and with them every link) and the state file. Idempotent."""
        # Signals would interrupt the deletions half way and leave namespaces behind.
        blocked = {signal.SIGINT, *_HANDLED_SIGNALS}
        in_main = threading.current_thread() is threading.main_thread()
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, blocked) if in_main else None
        try:
            for ns in net.list_namespaces(f"{NAME_PREFIX}{self.config.name}-"):
                net.delete_namespace(ns)
            _remove_state(self.config.name, self.state_dir)
        finally:
            self._up = False
            with _LIVE_LOCK:
                _LIVE.pop(self.config.name, None)
            if old_mask is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)

    def __enter__(self) -> Testbed:
        self._install_signal_handlers()
        try:
            return self.up()
        except BaseException:
            self._restore_signal_handlers()
            raise

    def __exit__(self, *exc: object) -> None:
        try:
            if not self.persistent:
                self.down()
        finally:
            self._restore_signal_handlers()

    def _install_signal_handlers(self) -> None:
        """Turn SIGTERM/SIGHUP into ``SystemExit`` so ``__exit__`` runs (Ctrl-C already does)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in _HANDLED_SIGNALS:
            if signal.getsignal(sig) is signal.SIG_DFL:
                self._old_handlers[sig] = signal.signal(sig, _raise_exit)

    def _restore_signal_handlers(self) -> None:
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers.clear()

    # ----------------------------------------------------------------- use
    def link_info(self) -> dict[str, str]:
        """Environment every rank gets: the testbed's shape and rates (for bounds in benchmarks)."""
        cfg = self.config
        info = {
            "MEGATRON_CHARM_TESTBED": cfg.name,
            "MEGATRON_CHARM_TESTBED_NODES": str(cfg.nodes),
            "MEGATRON_CHARM_TESTBED_RANKS_PER_NODE": str(cfg.ranks_per_node),
            "MEGATRON_CHARM_TESTBED_TOPOLOGY": cfg.topology,
            "MEGATRON_CHARM_TESTBED_CROSS_BPS": str(self.cross_rate_bps or 0),
        }
        if self.intra_rate_bps:
            info["MEGATRON_CHARM_TESTBED_INTRA_BPS"] = str(self.intra_rate_bps)
        return info

    def run(
        self,
        cmd: Sequence[str],
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        env: Mapping[str, str] | None = None,
        capture: bool = False,
        log_dir: str | None = None,
        placements: Sequence[tuple[int, int]] | None = None,
    ) -> RunResult:
        """Run ``cmd`` as every rank (see :func:`megatron_charm.testbed.launch.launch`)."""
        if not self._up:
            raise TestbedError(f"testbed {self.config.name!r} is not up; call up() or use 'with'")
        return launch(
            self.config,
            cmd,
            placements=placements,
            timeout_s=timeout_s,
            env=env,
            capture=capture,
            log_dir=log_dir,
            link_info=self.link_info(),
        )

    def describe(self) -> dict[str, Any]:
        """Shape, rates and per-rank addresses, JSON-serialisable."""
        cfg = self.config
        return {
            "config": cfg.to_dict(),
            "cross_rate_bps": self.cross_rate_bps,
            "intra_rate_bps": self.intra_rate_bps,
            "measured_intra_bps": self.measured_intra_bps,
            "namespaces": self.namespaces,
            "ranks": [
                {
                    "global_rank": n * cfg.ranks_per_node + i,
                    "node": n,
                    "local": i,
                    "address": rank_address(n, i),
                    "ifname": rank_ifname(i),
                }
                for n in range(cfg.nodes)
                for i in range(cfg.ranks_per_node)
            ],
            "links": [
                {
                    "nodes": [lk.a, lk.b],
                    "rail": lk.rail,
                    "ifnames": [lk.ifname(lk.a), lk.ifname(lk.b)],
                }
                for lk in cross_links(cfg)
            ],
            "owner_pid": os.getpid(),
            "persistent": self.persistent,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }

    def _write_state(self) -> None:
        os.makedirs(self.state_dir, exist_ok=True)
        with open(_state_path(self.config.name, self.state_dir), "w") as f:
            json.dump(self.describe(), f, indent=1)

    @classmethod
    def attach(cls, name: str, state_dir: str = STATE_DIR) -> Testbed:
        """A handle on a testbed that ``up`` left running (its ``down`` removes it); ``state_dir``
        as the ``state_dir`` it was brought up with."""
        path = _state_path(name, state_dir)
        if not os.path.exists(path) or not net.list_namespaces(f"{NAME_PREFIX}{name}-"):
            raise TestbedError(
                f"no testbed named {name!r} is up; start one with "
                f"'python -m megatron_charm.testbed up --name {name} ...'"
            )
        with open(path) as f:
            state = json.load(f)
        tb = cls(TestbedConfig.from_dict(state["config"]), persistent=True, state_dir=state_dir)
        tb.cross_rate_bps = state["cross_rate_bps"]
        tb.intra_rate_bps = state["intra_rate_bps"]
        tb.measured_intra_bps = state["measured_intra_bps"]
        tb._up = True
        return tb


def cleanup(name: str | None = None, state_dir: str = STATE_DIR) -> list[str]:
    """Remove leftover namespaces and state (in ``state_dir``) of testbed ``name`` (all
    testbeds when ``None``).

    Returns the namespaces removed. Needs no record of how they were made: the name prefix is
    enough, and deleting a namespace deletes the veth ends inside it.
    """
    prefix = NAME_PREFIX if name is None else f"{NAME_PREFIX}{name}-"
    removed = [ns for ns in net.list_namespaces(prefix) if net.delete_namespace(ns)]
    if os.path.isdir(state_dir):
        for entry in os.listdir(state_dir):
            if entry.endswith(".json") and (name is None or entry == f"{name}.json"):
                _remove_state(entry[: -len(".json")], state_dir)
    return removed


def _state_path(name: str, state_dir: str) -> str:
    return os.path.join(state_dir, f"{name}.json")


def _remove_state(name: str, state_dir: str) -> None:
    try:
        os.remove(_state_path(name, state_dir))
    except FileNotFoundError:
        pass
    try:
        os.rmdir(state_dir)  # only when no other testbed is up
    except OSError:
        pass


def _raise_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


@atexit.register
def _teardown_live() -> None:
    """Last line of defence: remove every non-persistent testbed this process still holds."""
    with _LIVE_LOCK:
        live = [tb for tb in _LIVE.values() if not tb.persistent]
    for tb in live:
        try:
            tb.down()
        except Exception:  # best effort at exit: there is no one left to report to
            pass
