#!/usr/bin/env bash
# Prepare this host for the emulated multi-node testbed (megatron_charm.testbed).
# Idempotent: installs iproute2 only when `ip` or `tc` is missing, then checks that network
# namespaces, veth pairs, the tbf qdisc and the HTB + u32 pair that queues acknowledgements
# first (Note [Acknowledgements first]) work. Needs root. Exit status 0 means ready.
set -euo pipefail

if [[ "$(id -u)" != 0 ]]; then
  echo "setup.sh: the testbed needs root (network namespaces, tc)" >&2
  exit 1
fi

if ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
  if command -v apt-get >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends iproute2
  else
    echo "setup.sh: 'ip'/'tc' missing and no apt-get; install iproute2 by hand" >&2
    exit 1
  fi
fi

# Self-check in a throw-away namespace pair; removed on any exit.
a="mctb-setup$$-a"
b="mctb-setup$$-b"
cleanup() { ip netns delete "$a" 2>/dev/null || true; ip netns delete "$b" 2>/dev/null || true; }
trap cleanup EXIT

ip netns add "$a"
ip netns add "$b"
ip link add x netns "$a" type veth peer name y netns "$b"
ip -n "$a" link set x up
ip -n "$b" link set y up
tc -n "$a" qdisc add dev x root handle 1: tbf rate 10mbit burst 32kb limit 1mb
if ! { tc -n "$a" qdisc add dev x parent 1:1 handle 10: htb default 20 &&
       tc -n "$a" class add dev x parent 10: classid 10:10 htb rate 10mbit prio 0 &&
       tc -n "$a" filter add dev x parent 10: protocol ip prio 1 u32 \
         match ip protocol 6 0xff match u16 0x0000 0xff80 at 2 flowid 10:10; }; then
  echo "setup.sh: this kernel lacks the htb qdisc or the u32 filter, which put TCP" \
    "acknowledgements ahead of data; pass --no-ack-priority to the testbed" >&2
  exit 1
fi
if tc -n "$a" qdisc replace dev x root netem delay 1ms 2>/dev/null; then
  netem="available (unused: the testbed shapes with tbf only)"
else
  netem="not available (fine: the testbed shapes with tbf only)"
fi
echo "testbed ready: $(ip -V); netns, veth, tbf, htb and u32 work; netem $netem"
