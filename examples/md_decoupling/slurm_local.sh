#!/usr/bin/env bash
# A single-node SLURM on this machine (slurmctld + slurmd on localhost, no munge), for testing
# the launcher and the sweep front-end for real. Installs Debian's slurm-wlm when it is missing
# and this shell may (root with apt-get).
#
#   bash examples/md_decoupling/slurm_local.sh start DIR   # prints: export SLURM_CONF=DIR/slurm.conf
#   bash examples/md_decoupling/slurm_local.sh stop DIR
#
# Exit status 3 from start: SLURM cannot be installed or started here (the message says why).
set -euo pipefail
cmd=${1:?usage: slurm_local.sh start|stop DIR}
DIR=$(mkdir -p "${2:?usage: slurm_local.sh start|stop DIR}" && cd "$2" && pwd)

stop() {
  for d in slurmd slurmctld; do
    if [ -f "$DIR/$d.pid" ]; then
      kill "$(cat "$DIR/$d.pid")" 2>/dev/null || true   # by pid file, never by name
      rm -f "$DIR/$d.pid"
    fi
  done
}

if [ "$cmd" = stop ]; then stop; exit 0; fi
[ "$cmd" = start ] || { echo "usage: slurm_local.sh start|stop DIR" >&2; exit 2; }

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null; then
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "slurm_local: SLURM is not installed and cannot be installed here (needs root and apt-get)" >&2
    exit 3
  fi
  echo "slurm_local: installing slurm-wlm (Debian)" >&2
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm; } \
    > "$DIR/apt.log" 2>&1 || { echo "slurm_local: apt-get install slurm-wlm failed ($DIR/apt.log)" >&2; exit 3; }
fi

HOST=$(hostname -s)
NCPU=$(nproc)
MEM=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) * 8 / 10240 ))
mkdir -p "$DIR/spool" "$DIR/state"
cat > "$DIR/slurm.conf" <<EOF
ClusterName=local
SlurmctldHost=$HOST
AuthType=auth/none
CredType=cred/none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SlurmUser=root
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmdSpoolDir=$DIR/spool
StateSaveLocation=$DIR/state
SlurmctldLogFile=$DIR/ctld.log
SlurmdLogFile=$DIR/d.log
ReturnToService=2
MpiDefault=none
MinJobAge=600
KillWait=30
JobRequeue=1
NodeName=$HOST CPUs=$NCPU RealMemory=$MEM State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
export SLURM_CONF=$DIR/slurm.conf
stop
slurmctld -f "$SLURM_CONF"
slurmd -f "$SLURM_CONF"
for _ in $(seq 60); do
  if sinfo -h -o %t 2>/dev/null | grep -qE '^(idle|mix|alloc)'; then
    echo "export SLURM_CONF=$SLURM_CONF"
    exit 0
  fi
  sleep 1
done
echo "slurm_local: the node did not come up within 60 s ($DIR/ctld.log, $DIR/d.log)" >&2
stop
exit 3
