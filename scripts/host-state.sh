#!/usr/bin/env bash
# Prints what shareguard's tests and showcase could leave on this host, one line per
# object, sorted: ifb and veth links (shareguard's queue pairs are veths), network namespaces, bpffs entries, top-level cgroup
# v2 directories, mounts, MPS directories. `make test` and `make showcase` take it before
# and after and fail on anything new: both must leave nothing behind.
set -uo pipefail
# ifb0 and ifb1 come with the ifb module, which the first ifb anyone makes loads.
ip -o link show type ifb 2>/dev/null | awk -F': ' '{print "ifb " $2}' | sed 's/@.*//' |
  grep -Ev '^ifb ifb[0-9]+$' || true
ip -o link show type veth 2>/dev/null | awk -F': ' '{print "veth " $2}' | sed 's/@.*//'
ip netns list 2>/dev/null | awk '{print "netns " $1}'
# maps.debug and progs.debug come with the bpffs mount itself.
for d in /sys/fs/bpf/*; do
  case "$d" in */maps.debug | */progs.debug) ;; *) [ -e "$d" ] && echo "bpffs $d" ;; esac
done
cg2=$(awk '$9 == "cgroup2" { print $5; exit }' /proc/self/mountinfo)
if [ -n "$cg2" ]; then
  for d in "$cg2"/*/; do [ -d "$d" ] && echo "cgroup $d"; done
fi
# The test cluster's too (tests/cluster/): its bridge, its nodes' cgroup roots in the v1
# hierarchies, its mounts, and processes of the programs it built.
ip -o link show type bridge 2>/dev/null | awk -F': ' '{print "bridge " $2}'
for d in /sys/fs/cgroup/*/*/; do
  case "$d" in "$cg2"/*) ;; *) [ -e "$d/cgroup.procs" ] && echo "cgroup $d" ;; esac
done
awk '{print "mount " $5}' /proc/self/mountinfo |
  grep -E '/(tmp|run/shareguard)/|shareguard-cluster' || true
for p in /proc/[0-9]*; do
  exe=$(readlink "$p/exe" 2>/dev/null) || continue
  case "$exe" in /var/cache/shareguard-cluster/*) echo "process $exe" ;; esac
done
for d in /run/shareguard-mps/*; do [ -e "$d" ] && echo "mps $d"; done
tc qdisc show 2>/dev/null | sed 's/^/tc /'
tc filter show dev lo ingress 2>/dev/null | sed 's/^/tc-filter lo /'

exit 0
