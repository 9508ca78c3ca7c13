#!/usr/bin/env bash
# A SLURM on this machine (slurmctld + slurmd, no munge), for testing the launcher and the sweep
# front-end for real. Installs Debian's slurm-wlm when it is missing and this shell may (root
# with apt-get).
#
#   bash examples/md_decoupling/slurm_local.sh start DIR             # one node: this machine
#   bash examples/md_decoupling/slurm_local.sh start DIR --nodes 2   # two nodes (root; below)
#   bash examples/md_decoupling/slurm_local.sh stop DIR
#
# start prints: export SLURM_CONF=DIR/slurm.conf
# Two nodes: node1 and node2 are this machine seen through Linux namespaces, as two hosts on one
# network: each its own host name and /etc/hosts (a mount namespace; the machine's own is not
# touched), node2 its own network namespace joined to node1's (this machine's) by a veth pair
# on $MD_SLURM_SUBNET.0/24 (default 10.254.77). Both see the same files, as a cluster's shared
# file system; both have every CPU of the machine. The batch script runs on node1; every name a
# job resolves (the rendezvous host, gloo's addresses) is a node's address on that network.
# Exit status 3 from start: SLURM cannot be installed or started here (the message says why).
set -euo pipefail
usage="usage: slurm_local.sh start DIR [--nodes 1|2] | stop DIR"
cmd=${1:?$usage}
DIR=$(mkdir -p "${2:?$usage}" && cd "$2" && pwd)
NODES=1
if [ "${3:-}" = --nodes ]; then NODES=${4:?$usage}; fi
SUBNET=${MD_SLURM_SUBNET:-10.254.77}

stop() {
  local f
  for f in "$DIR"/slurmd*.pid "$DIR/slurmctld.pid" "$DIR"/ns-*.pid; do
    if [ -f "$f" ]; then
      kill "$(cat "$f")" 2>/dev/null || true   # by pid file, never by name
      rm -f "$f"
    fi
  done
  if [ -f "$DIR/veth" ]; then  # the pair goes with either end
    ip link del "$(cat "$DIR/veth")" 2>/dev/null || true
    rm -f "$DIR/veth"
  fi
}

if [ "$cmd" = stop ]; then stop; exit 0; fi
[ "$cmd" = start ] || { echo "$usage" >&2; exit 2; }
case "$NODES" in 1|2) ;; *) echo "slurm_local: --nodes 1 or 2 (got $NODES)" >&2; exit 2 ;; esac

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null; then
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "slurm_local: SLURM is not installed and cannot be installed here (needs root and apt-get)" >&2
    exit 3
  fi
  echo "slurm_local: installing slurm-wlm (Debian)" >&2
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm; } \
    > "$DIR/apt.log" 2>&1 || { echo "slurm_local: apt-get install slurm-wlm failed ($DIR/apt.log)" >&2; exit 3; }
fi

NCPU=$(nproc)
MEM=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) * 8 / 10240 ))
stop
mkdir -p "$DIR/state"

# node NAME FLAGS...: a process holding node NAME's new namespaces (unshare FLAGS), pid in
# ns-NAME.pid, its host name NAME and $DIR/hosts for /etc/hosts
node() {
  local name=$1 pid=""; shift
  unshare "$@" --fork sleep infinity < /dev/null > /dev/null 2>&1 &  # holds no caller's pipe
  for _ in $(seq 50); do
    pid=$(pgrep -P $! sleep || true)
    [ -n "$pid" ] && break
    sleep 0.1
  done
  [ -n "$pid" ] || { echo "slurm_local: unshare $* did not start" >&2; stop; exit 3; }
  echo "$pid" > "$DIR/ns-$name.pid"
  in_node "$name" sh -c "hostname $name && mount --bind '$DIR/hosts' /etc/hosts"
}
# in_node NAME CMD...: CMD in node NAME's namespaces
in_node() {
  local pid
  pid=$(cat "$DIR/ns-$1.pid")
  shift
  nsenter -t "$pid" --uts --mount --net "$@"
}

if [ "$NODES" = 1 ]; then
  HOST=$(hostname -s)
  CTLD_HOST=$HOST
  NODE_LINES="NodeName=$HOST CPUs=$NCPU RealMemory=$MEM State=UNKNOWN"
  NODE_LIST=$HOST
  PORTS=""
else
  if [ "$(id -u)" != 0 ] || ! command -v ip >/dev/null || ! command -v unshare >/dev/null; then
    echo "slurm_local: two nodes need root, ip and unshare (Linux namespaces)" >&2
    exit 3
  fi
  if ip -o addr | grep -q " $SUBNET\."; then
    echo "slurm_local: $SUBNET.0/24 is in use here; set MD_SLURM_SUBNET to a free /24 prefix" >&2
    exit 3
  fi
  printf '127.0.0.1 localhost\n%s.1 node1\n%s.2 node2\n' "$SUBNET" "$SUBNET" > "$DIR/hosts"
  CTLD_HOST="node1($SUBNET.1)"
  NODE_LINES="NodeName=node1 NodeAddr=$SUBNET.1 CPUs=$NCPU RealMemory=$((MEM / 2)) State=UNKNOWN
NodeName=node2 NodeAddr=$SUBNET.2 CPUs=$NCPU RealMemory=$((MEM / 2)) State=UNKNOWN"
  NODE_LIST=node1,node2
  # beside a one-node SLURM of this script (6817, 6818)
  PORTS=$'SlurmctldPort=6827\nSlurmdPort=6828'
  {
    ip link add mdslurm0 type veth peer name mdslurm1 && echo mdslurm0 > "$DIR/veth" &&
      ip addr add "$SUBNET.1/24" dev mdslurm0 && ip link set mdslurm0 up
  } || { echo "slurm_local: cannot make a veth pair here" >&2; stop; exit 3; }
  node node1 --uts --mount          # this machine's network
  node node2 --uts --mount --net    # its own, joined by the veth pair
  ip link set mdslurm1 netns "$(cat "$DIR/ns-node2.pid")"
  in_node node2 sh -c "ip link set lo up && ip addr add $SUBNET.2/24 dev mdslurm1 &&
    ip link set mdslurm1 up" || { echo "slurm_local: node2's network failed" >&2; stop; exit 3; }
fi

cat > "$DIR/slurm.conf" <<EOF
ClusterName=local$NODES
SlurmctldHost=$CTLD_HOST
$PORTS
AuthType=auth/none
CredType=cred/none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SlurmUser=root
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmdSpoolDir=$DIR/spool-%n
StateSaveLocation=$DIR/state
SlurmctldLogFile=$DIR/ctld.log
SlurmdLogFile=$DIR/d-%n.log
ReturnToService=2
MpiDefault=none
MinJobAge=600
KillWait=30
JobRequeue=1
$NODE_LINES
PartitionName=debug Nodes=$NODE_LIST Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
export SLURM_CONF=$DIR/slurm.conf
if [ "$NODES" = 1 ]; then
  slurmctld -f "$SLURM_CONF"
  slurmd -f "$SLURM_CONF"
else  # the controller where the host name is node1's
  in_node node1 sh -c "slurmctld -f '$SLURM_CONF' && slurmd -f '$SLURM_CONF'"
  in_node node2 slurmd -f "$SLURM_CONF"
fi
for _ in $(seq 60); do
  up=$(sinfo -h -N -o %t 2>/dev/null | grep -cE '^(idle|mix|alloc)' || true)
  if [ "$up" = "$NODES" ]; then
    echo "export SLURM_CONF=$SLURM_CONF"
    exit 0
  fi
  sleep 1
done
echo "slurm_local: the nodes did not come up within 60 s ($DIR/ctld.log, $DIR/d-*.log)" >&2
stop
exit 3
