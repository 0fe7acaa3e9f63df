#!/usr/bin/env bash
# A real 2-node SLURM cluster on this one machine, to try the SLURM path (and run its tests) before a real cluster.
#
#   make slurm-local         # = scripts/slurm_local.sh start   (root; installs Debian's slurm + munge if missing)
#   make slurm-local-stop    # = scripts/slurm_local.sh stop    (stops the daemons this script started, by pid)
#   scripts/slurm_local.sh status
#
# Debian's slurm (22.05) lets several slurmd run on one host: nodes n1 and n2 both live at 127.0.0.1 with ports
# of their own, each started as `slurmd -N <node>`. The node names must resolve (torch's rendezvous connects to
# the job's first node by name), so `127.0.0.1 n1 n2` goes into /etc/hosts. Each node declares 8 CPUs whatever
# the host has (SlurmdParameters=config_overrides): several multi-task jobs run side by side, as on a real cluster.
# Starting is idempotent: daemons whose pid file names a live process are left alone.
set -euo pipefail

STATE_DIR=${LEROBOT_MG_SLURM_DIR:-/var/lib/lerobot_mg_slurm}
CONF=/etc/slurm/slurm.conf
MARKER="# written by lerobot_mg scripts/slurm_local.sh"
NODES=(n1 n2)
MUNGE_SOCKET=/run/munge/munge.socket.2

need_root() {
    if [[ $(id -u) != 0 ]]; then
        echo "slurm_local.sh: run as root (it installs packages, writes $CONF and /etc/hosts, starts daemons)" >&2
        exit 1
    fi
}

alive() {  # alive PIDFILE: the pid file names a running process
    [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null
}

install_packages() {
    local missing=()
    for bin in slurmctld slurmd munged sbatch; do
        command -v "$bin" >/dev/null || missing+=("$bin")
    done
    if ((${#missing[@]})); then
        echo "installing slurmctld slurmd munge slurm-client (missing: ${missing[*]})"
        apt-get update
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends slurmctld slurmd munge slurm-client
    fi
}

write_config() {
    if [[ -e $CONF ]] && ! grep -qF "$MARKER" "$CONF"; then
        echo "slurm_local.sh: $CONF exists and was not written by this script; not touching a real cluster's config" >&2
        exit 1
    fi
    mkdir -p "$STATE_DIR" /etc/slurm
    local host
    host=$(hostname -s)
    cat >"$CONF.tmp" <<EOF
$MARKER
ClusterName=lerobot-mg-local
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued job may start again cred_expire + 1 s after the requeue (SLURM default 120 s): keep the wait short.
AuthInfo=cred_expire=5
CredType=cred/munge
StateSaveLocation=$STATE_DIR/slurmctld
SlurmdSpoolDir=$STATE_DIR/slurmd-%n
SlurmctldPidFile=$STATE_DIR/slurmctld.pid
SlurmdPidFile=$STATE_DIR/slurmd-%n.pid
SlurmctldLogFile=$STATE_DIR/slurmctld.log
SlurmdLogFile=$STATE_DIR/slurmd-%n.log
# Several slurmd on one host, without cgroups: plain process tracking, no task binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/builtin
# SIGTERM (scancel, scontrol requeue, preemption) is followed by SIGKILL this many seconds later: the run saves in
# between. Real clusters set it (and the preemption GraceTime) by policy; here it is generous for a loaded machine.
KillWait=120
# Requeued jobs become eligible by the clock, not by an event: look at the queue every second.
SchedulerParameters=sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
MailProg=/bin/true
NodeName=n1 NodeAddr=127.0.0.1 Port=17001 CPUs=8 State=UNKNOWN
NodeName=n2 NodeAddr=127.0.0.1 Port=17002 CPUs=8 State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
EOF
    mv "$CONF.tmp" "$CONF"
}

resolve_nodes() {
    for node in "${NODES[@]}"; do
        if ! getent hosts "$node" >/dev/null; then
            echo "127.0.0.1 $node" >>/etc/hosts
        fi
    done
}

start() {
    need_root
    install_packages
    write_config
    resolve_nodes
    mkdir -p "$STATE_DIR/slurmctld" /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge
    if [[ ! -S $MUNGE_SOCKET ]] || ! alive /run/munge/munged.pid; then
        runuser -u munge -- /usr/sbin/munged --force
        for _ in $(seq 50); do alive /run/munge/munged.pid && break; sleep 0.1; done
        cp /run/munge/munged.pid "$STATE_DIR/munged.pid"  # ours to stop; a munged that was already running is not
    fi
    alive "$STATE_DIR/slurmctld.pid" || slurmctld -i
    for node in "${NODES[@]}"; do
        mkdir -p "$STATE_DIR/slurmd-$node"
        alive "$STATE_DIR/slurmd-$node.pid" || slurmd -N "$node"
    done
    # Up when both nodes are idle (or allocated/mixed: jobs left over from before are fine).
    for _ in $(seq 60); do
        if [[ $(sinfo -h -N -o '%N %t' 2>/dev/null | grep -cE ' (idle|mix|alloc)$') == "${#NODES[@]}" ]]; then
            sinfo -N
            return 0
        fi
        # A node left DOWN by an earlier stop comes back once its slurmd registers again.
        scontrol update nodename=n1,n2 state=resume >/dev/null 2>&1 || true
        sleep 0.5
    done
    echo "slurm_local.sh: the nodes did not come up; logs in $STATE_DIR" >&2
    sinfo -N >&2 || true
    exit 1
}

stop() {
    need_root
    local pidfiles=("$STATE_DIR"/slurmd-*.pid "$STATE_DIR/slurmctld.pid" "$STATE_DIR/munged.pid")
    for pidfile in "${pidfiles[@]}"; do
        if alive "$pidfile"; then
            kill "$(cat "$pidfile")"
        fi
    done
    for pidfile in "${pidfiles[@]}"; do
        for _ in $(seq 50); do
            alive "$pidfile" || break
            sleep 0.1
        done
        rm -f "$pidfile"
    done
    echo "local SLURM cluster stopped"
}

status() {
    for pidfile in "$STATE_DIR"/slurmd-*.pid "$STATE_DIR/slurmctld.pid" "$STATE_DIR/munged.pid"; do
        if alive "$pidfile"; then echo "running: $pidfile ($(cat "$pidfile"))"; else echo "stopped: $pidfile"; fi
    done
    sinfo -N 2>/dev/null || true
}

case ${1:-} in
    start) start ;;
    stop) stop ;;
    status) status ;;
    *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
