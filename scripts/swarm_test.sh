#!/usr/bin/env bash
# End-to-end test of docker/stack.yml on a single-node Docker Swarm, with the image compose-test builds:
#
#   1. the image cmemi:compose-test: reused when present (CI runs compose-test first with
#      CMEMI_COMPOSE_KEEP_IMAGE=1), else built by running scripts/compose_test.sh that way;
#   2. a Docker engine (dockerd started here and stopped at the end, as compose-test does), a one-node
#      swarm (`docker swarm init`), the node labelled cmemi.runs=true, the Redis password as a swarm secret,
#      the CurveZMQ keys made by `cmemi keys` (in the image) and each file made a secret `cmemi-FILE`, as the
#      manual (docs/deployment/swarm.md) and docker/stack.yml document it;
#   3. a fault-free reference run inside the image (`cmemi up`), giving params_sha256;
#   4. `docker stack deploy` with 2 workers, scaled to 3 mid-run (`docker service scale`), one worker's
#      container SIGKILLed: the coordinator declares it dead and fences it, swarm starts a new task by
#      itself (restart_policy on-failure), the run completes with the reference's params_sha256 and every
#      service ends in a completed (exit 0) task;
#   4b. the same run as a second stack with two parameter-server shards (docker/stack.shards.yml): shard 1's
#      container SIGKILLed, swarm restarts it, the cluster rolls back to a checkpoint, the reference's
#      params_sha256 at the end;
#   5. teardown WHATEVER happens: the stack, its volume, the secrets, the swarm, the image (unless
#      CMEMI_SWARM_KEEP_IMAGE=1), the daemon, and the iptables/nftables rules, ip_forward and interfaces
#      it changed.
#
# Run as root:  make swarm-test   (or bash scripts/swarm_test.sh). Exit 0 only when all checks pass.
# Knobs: CMEMI_SWARM_STEPS (default 4000), CMEMI_SWARM_KEEP_IMAGE=1.

set -Eeuo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STACK=cmemi-swarm-test
IMAGE=cmemi:compose-test
STEPS=${CMEMI_SWARM_STEPS:-4000}
RUN_NAME=digits
CONFIG=/app/examples/digits.yaml
OVERRIDES=(--set "train.steps=$STEPS" --set "scheduler.kwargs.T_max=$STEPS" --set "checkpoint.every_steps=500"
           --set "cluster.dead_after=1.0")

T_START=$(date +%s)
WORK=""
DOCKERD_PID=""
STARTED_DOCKERD=0
SWARM_UP=0
FAILED_PHASE=""
declare -A IFACES_BEFORE=()

log() { printf '[swarm-test %5ss] %s\n' "$(( $(date +%s) - T_START ))" "$*"; }
die() { printf '[swarm-test] FAILED%s: %s\n' "${FAILED_PHASE:+ in phase '$FAILED_PHASE'}" "$*" >&2; exit 1; }
phase() { FAILED_PHASE=$1; log "== $1"; }
phase_done() { log "== $FAILED_PHASE: done"; FAILED_PHASE=""; }
wait_for_quiet() {
    local deadline=$((SECONDS + $1)); shift
    until "$@" >/dev/null 2>&1; do
        (( SECONDS < deadline )) || return 1
        sleep 0.5
    done
}
wait_for() {
    local what=$1 timeout=$2; shift 2
    wait_for_quiet "$timeout" "$@" || die "timed out after ${timeout}s waiting for $what"
}

# ------------------------------------------------------------------------------------------ cleanup
restore_network() {
    [[ -f $WORK/ip_forward ]] && { cat "$WORK/ip_forward" > /proc/sys/net/ipv4/ip_forward || true; }
    if [[ -f $WORK/nft.mode ]]; then
        local fam tbl
        for fam in ip ip6; do
            for tbl in filter nat; do
                nft list table "$fam" "$tbl" >/dev/null 2>&1 && { nft delete table "$fam" "$tbl" || true; }
                [[ -s $WORK/nft.$fam.$tbl ]] && { nft -f "$WORK/nft.$fam.$tbl" || log "warning: could not restore nft $fam $tbl"; }
            done
        done
    elif [[ -f $WORK/iptables.mode ]]; then
        local cmd tbl
        for cmd in iptables ip6tables; do
            command -v "$cmd" >/dev/null || continue
            for tbl in filter nat; do "$cmd" -t "$tbl" -F 2>/dev/null || true; "$cmd" -t "$tbl" -X 2>/dev/null || true; done
            "$cmd" -P FORWARD ACCEPT 2>/dev/null || true
            [[ -s $WORK/$cmd.rules ]] && "$cmd-restore" < "$WORK/$cmd.rules" 2>/dev/null || true
        done
    fi
    local m
    findmnt -rn -o TARGET | { grep -E '^(/var)?/run/docker/|^/var/lib/docker/' || true; } | sort -r | while read -r m; do
        grep -qxF "$m" "$WORK/mounts" 2>/dev/null || umount -l "$m" 2>/dev/null || true
    done
    local iface
    for iface in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1); do
        if [[ -z ${IFACES_BEFORE[$iface]:-} && ( $iface == docker0 || $iface == docker_gwbridge || $iface == br-* \
              || $iface == veth* || $iface == vx-* ) ]]; then
            ip link delete "$iface" 2>/dev/null || true
        fi
    done
}

dump_logs() {
    [[ $SWARM_UP == 1 ]] || return 0
    echo "---- docker stack ps" >&2
    timeout 30 docker stack ps --no-trunc "$STACK" >&2 2>&1 || true
    local svc
    for svc in coordinator aggregator checkpointer worker; do
        echo "---- $svc (last lines)" >&2
        timeout 30 docker service logs --raw --tail 15 "${STACK}_$svc" >&2 2>&1 || true
    done
}

cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    set +e
    [[ $rc != 0 ]] && dump_logs
    log "== teardown"
    if [[ -n $WORK ]] && timeout 30 docker info >/dev/null 2>&1; then
        if [[ $SWARM_UP == 1 ]]; then
            timeout 120 docker stack rm "$STACK" >/dev/null 2>&1
            wait_for_quiet 120 sh -c "[ -z \"\$(docker ps -aq --filter label=com.docker.stack.namespace=$STACK)\" ]"
            docker ps -aq --filter "label=com.docker.stack.namespace=$STACK" | xargs -r docker rm -f >/dev/null 2>&1
            docker volume ls -q --filter "label=com.docker.stack.namespace=$STACK" | xargs -r docker volume rm -f >/dev/null 2>&1
            docker secret ls -q --filter name=cmemi | xargs -r timeout 60 docker secret rm >/dev/null 2>&1
            timeout 120 docker swarm leave --force >/dev/null 2>&1
        fi
        timeout 60 docker rm -f "$STACK-reference" >/dev/null 2>&1
        [[ ${CMEMI_SWARM_KEEP_IMAGE:-0} == 1 ]] || timeout 300 docker rmi -f "$IMAGE" >/dev/null 2>&1
    fi
    if [[ $STARTED_DOCKERD == 1 && -n $DOCKERD_PID ]]; then
        kill -TERM "$DOCKERD_PID" 2>/dev/null
        local deadline=$((SECONDS + 60))
        while kill -0 "$DOCKERD_PID" 2>/dev/null && (( SECONDS < deadline )); do sleep 0.2; done
        kill -0 "$DOCKERD_PID" 2>/dev/null && { kill -KILL "$DOCKERD_PID" 2>/dev/null; sleep 1; }
        restore_network
    fi
    [[ -n $WORK && -d $WORK ]] && rm -rf --one-file-system "$WORK"
    if [[ $rc == 0 ]]; then log "PASSED"; else log "FAILED (exit $rc)"; fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

[[ $(id -u) == 0 ]] || die "run as root (it starts dockerd)"

# ------------------------------------------------------------------------------------------ 1. image
# Whether the image is there needs a daemon; compose-test starts and stops its own, so look with a short-lived
# one only if none runs. Simplest and honest: ask compose-test to build (and keep) it when our daemon lacks it.
start_dockerd() {
    cat /proc/sys/net/ipv4/ip_forward > "$WORK/ip_forward"
    for iface in $(ip -o link show | awk -F': ' '{print $2}' | cut -d@ -f1); do IFACES_BEFORE[$iface]=1; done
    findmnt -rn -o TARGET > "$WORK/mounts"
    if iptables -V 2>/dev/null | grep -q nf_tables && command -v nft >/dev/null; then
        for fam in ip ip6; do for tbl in filter nat; do
            nft list table "$fam" "$tbl" > "$WORK/nft.$fam.$tbl" 2>/dev/null || : > "$WORK/nft.$fam.$tbl"
        done; done
        touch "$WORK/nft.mode"
    else
        iptables-save > "$WORK/iptables.rules" 2>/dev/null || true
        ip6tables-save > "$WORK/ip6tables.rules" 2>/dev/null || true
        touch "$WORK/iptables.mode"
    fi
    STARTED_DOCKERD=1
    setsid dockerd >"$WORK/dockerd.log" 2>&1 < /dev/null &
    DOCKERD_PID=$!
    local deadline=$((SECONDS + 90))
    until docker info >/dev/null 2>&1; do
        kill -0 "$DOCKERD_PID" 2>/dev/null || { tail -20 "$WORK/dockerd.log" >&2; die "dockerd exited"; }
        (( SECONDS < deadline )) || { tail -20 "$WORK/dockerd.log" >&2; die "dockerd did not answer within 90s"; }
        sleep 0.5
    done
    log "started dockerd (pid $DOCKERD_PID)"
}

WORK=$(mktemp -d /tmp/cmemi-swarm-test.XXXXXX)
phase "image"
if ! command -v dockerd >/dev/null || ! { timeout 30 docker info >/dev/null 2>&1 || [[ -d /var/lib/docker ]]; }; then
    NEED_BUILD=1   # no engine or no image store yet: compose-test installs the engine and builds the image
else
    NEED_BUILD=0
fi
if [[ $NEED_BUILD == 0 ]] && ! timeout 30 docker info >/dev/null 2>&1; then
    start_dockerd
    docker image inspect "$IMAGE" >/dev/null 2>&1 || NEED_BUILD=1
    if [[ $NEED_BUILD == 1 ]]; then   # hand the daemon over to compose-test, then start ours again
        kill -TERM "$DOCKERD_PID"; wait "$DOCKERD_PID" 2>/dev/null || true
        restore_network; STARTED_DOCKERD=0; DOCKERD_PID=""
    fi
elif [[ $NEED_BUILD == 0 ]]; then
    docker image inspect "$IMAGE" >/dev/null 2>&1 || NEED_BUILD=1
fi
if [[ $NEED_BUILD == 1 ]]; then
    log "no $IMAGE: running compose-test with CMEMI_COMPOSE_KEEP_IMAGE=1 to build it"
    CMEMI_COMPOSE_KEEP_IMAGE=1 bash "$REPO/scripts/compose_test.sh" || die "compose-test (building $IMAGE) failed"
fi
mkdir -p /run/lock
exec 9>/run/lock/cmemi-compose-test.lock   # one Docker test at a time: the daemon and the network are shared
flock -w 1800 9 || die "another Docker test holds /run/lock/cmemi-compose-test.lock"
if ! timeout 30 docker info >/dev/null 2>&1; then start_dockerd; fi
docker image inspect "$IMAGE" >/dev/null 2>&1 || die "no image $IMAGE"
log "image $IMAGE"
phase_done

# ------------------------------------------------------------------------------------------ 2. swarm
phase "single-node swarm"
ADDR=$(ip -4 route get 1.1.1.1 2>/dev/null | awk '{for (i = 1; i < NF; i++) if ($i == "src") print $(i + 1)}' | head -1)
[[ -n $ADDR ]] || ADDR=$(hostname -I | awk '{print $1}')
[[ $(docker info -f '{{.Swarm.LocalNodeState}}') == inactive ]] || die "this engine is already part of a swarm"
SWARM_UP=1
timeout 120 docker swarm init --advertise-addr "$ADDR" >/dev/null || die "docker swarm init failed"
NODE=$(docker info -f '{{.Swarm.NodeID}}')
docker node update --label-add cmemi.runs=true "$NODE" >/dev/null
# the password goes from python3 through a pipe into the secret: never an argument, never in this shell
python3 -c 'import secrets; print(secrets.token_hex(16), end="")' | docker secret create cmemi_redis_password - >/dev/null \
    || die "docker secret create cmemi_redis_password failed"
# CurveZMQ keys, the documented step: `cmemi keys DIR`, then each file a secret cmemi-FILE (docker/stack.yml)
mkdir -m 700 "$WORK/keys"
docker run --rm --network none --user "$(id -u):$(id -g)" -v "$WORK/keys:/keys" "$IMAGE" keys /keys >/dev/null \
    || die "cmemi keys (in $IMAGE) failed"
for f in "$WORK"/keys/*; do
    docker secret create "cmemi-${f##*/}" "$f" >/dev/null || die "docker secret create cmemi-${f##*/} failed"
done
rm -rf "$WORK/keys"
log "swarm on $ADDR (node $NODE, label cmemi.runs=true), secrets: $(docker secret ls --format '{{.Name}}' | sort | xargs)"
phase_done

# ------------------------------------------------------------------------------------------ 3. reference
phase "fault-free reference run (cmemi up inside the image)"
REF=$STACK-reference
docker run --detach --name "$REF" --network none --entrypoint sh "$IMAGE" -c \
    'cmemi up "$0" "$@" --set run.dir=/tmp/ref >/tmp/up.log 2>&1 || { tail -40 /tmp/up.log >&2; exit 1; }
     cat /tmp/ref/summary.json' "$CONFIG" "${OVERRIDES[@]}" >/dev/null || die "cannot start the reference run"
exited() { [[ $(docker inspect -f '{{.State.Status}}' "$1") == exited ]]; }
wait_for "the reference run" 900 exited "$REF"
[[ $(docker inspect -f '{{.State.ExitCode}}' "$REF") == 0 ]] || { docker logs "$REF" 2>&1 | tail -40 >&2; die "the reference run failed"; }
REF_SHA=$(docker logs "$REF" 2>/dev/null | python3 -c 'import json, sys; print(json.load(sys.stdin)["params_sha256"])')
docker rm -f "$REF" >/dev/null
log "reference: params_sha256 $REF_SHA"
phase_done

# ------------------------------------------------------------------------------------------ 4. the stack
phase "docker stack deploy (2 workers)"
python3 "$REPO/scripts/test_overrides.py" "$WORK/stack.test.yml" "$CONFIG" --stack -- "${OVERRIDES[@]}"
CMEMI_IMAGE=$IMAGE REDIS_IMAGE=$IMAGE CMEMI_CONFIG=$CONFIG CMEMI_WORKERS=2 timeout 300 \
    docker stack deploy --resolve-image never -c "$REPO/docker/stack.yml" -c "$WORK/stack.test.yml" "$STACK" \
    >"$WORK/deploy.log" 2>&1 || { cat "$WORK/deploy.log" >&2; die "docker stack deploy failed"; }
tasks_of() {  # running containers of a service
    docker ps -q --filter "label=com.docker.swarm.service.name=${STACK}_$1" --filter status=running
}
redis_cid() { tasks_of redis | head -1; }
wait_for "the redis task" 300 sh -c "[ -n \"\$(docker ps -q --filter label=com.docker.swarm.service.name=${STACK}_redis --filter status=running)\" ]"
# redis-cli inside the Redis task, the password from its secret into REDISCLI_AUTH (not onto any command line)
rcli() { docker exec "$(redis_cid)" sh -c 'REDISCLI_AUTH="$(cat /run/secrets/cmemi_redis_password)" exec redis-cli "$@"' rcli "$@"; }
progress() { rcli hget "cmemi:$RUN_NAME:progress" "$1" | tr -d '\r'; }
# The run volume, read from a throwaway container (the stack's volume on this node).
VOLUME=${STACK}_runs
run_file() { docker run --rm --network none -v "$VOLUME:/runs:ro" --entrypoint cat "$IMAGE" "/runs/$1"; }
live_workers() { [[ $(progress live_workers) == "$1" ]]; }
wait_for "both workers to train (live_workers=2)" 300 live_workers 2
# One key per container: each running task sees in /run/secrets (security.keys_dir) only its role's secret keys.
own_secrets() {  # SERVICE EXPECTED: the sorted *.key_secret names inside each of its running tasks
    local c got
    for c in $(tasks_of "$1"); do
        got=$(docker exec "$c" sh -c 'cd /run/secrets && ls *.key_secret' | sort | tr '\n' ' ')
        [[ $got == "$2" ]] || die "$1 task ${c:0:12} holds secret keys '$got', expected '$2'"
    done
}
own_secrets worker "worker.key_secret "
own_secrets aggregator "aggregator.key_secret server.key_secret "
own_secrets checkpointer "server.key_secret "
own_secrets coordinator "coordinator.key_secret "
log "each task holds only its own role's secret keys"
phase_done

STATE_KEY="cmemi:$RUN_NAME:state"
wait_step() {
    local target=$1 deadline=$((SECONDS + $2)) step
    while :; do
        step=$(progress step 2>/dev/null) || true
        [[ $step =~ ^[0-9]+$ ]] || step=0
        (( step >= target )) && return 0
        [[ $(rcli get "$STATE_KEY" 2>/dev/null | tr -d '\r') == failed ]] && die "the run failed: $(rcli get "cmemi:$RUN_NAME:error")"
        (( SECONDS < deadline )) || die "timed out at step $step waiting for step $target"
        sleep 0.5
    done
}

phase "scale the workers to 3"
wait_step $((STEPS / 10)) 300
timeout 120 docker service scale --detach "${STACK}_worker=3" >/dev/null || die "docker service scale failed"
wait_for "three workers to train (live_workers=3)" 300 live_workers 3
log "3 workers at step $(progress step)"
phase_done

phase "kill a worker mid-run"
wait_step $((STEPS / 4)) 300
VICTIM=$(tasks_of worker | head -1)
VICTIM_HOST=$(docker inspect -f '{{.Config.Hostname}}' "$VICTIM")
docker kill "$VICTIM" >/dev/null || die "docker kill failed"
KILL_STEP=$(progress step)
log "docker kill $VICTIM_HOST at step $KILL_STEP of $STEPS"
(( KILL_STEP < STEPS )) || die "the run ended before the kill: raise CMEMI_SWARM_STEPS"
event_seen() {  # event_seen KIND [HOST_PREFIX]: an event of KIND about a worker whose id starts with HOST_PREFIX-
    run_file events.jsonl | python3 -c '
import json, sys
kind, host = sys.argv[1], sys.argv[2]
for line in sys.stdin:
    e = json.loads(line)
    wid = str(e.get("id") if e.get("role") == "worker" else e.get("worker"))
    if e["kind"] == kind and (not host or wid.startswith(host + "-")):
        print(wid); sys.exit(0)
sys.exit(1)' "$1" "${2:-}"
}
wait_for "the coordinator to declare the killed worker dead" 60 event_seen died "$VICTIM_HOST"
wait_for "the coordinator to fence the killed worker" 60 event_seen fenced "$VICTIM_HOST"
# swarm (not the test) starts a new task in the killed one's place: three running workers again
three_running() { [[ $(tasks_of worker | wc -l) == 3 ]] && ! tasks_of worker | grep -q "^${VICTIM:0:12}"; }
wait_for "swarm to replace the killed worker's task" 120 three_running
run_completed() { [[ $(rcli get "$STATE_KEY" | tr -d '\r') == completed ]]; }
replacement_or_done() { live_workers 3 || run_completed; }
wait_for "the replacement to train (live_workers=3)" 300 replacement_or_done
live_workers 3 || die "the run completed before the replacement trained: raise CMEMI_SWARM_STEPS"
log "swarm replaced the killed task; 3 workers at step $(progress step)"
phase_done

phase "training to the end"
wait_step "$STEPS" 900
wait_for "run state completed" 120 run_completed
SUMMARY=$(run_file summary.json) || die "no summary.json in the run volume"
SHA=$(python3 -c 'import json, sys; print(json.loads(sys.argv[1])["params_sha256"])' "$SUMMARY")
RUN_STEPS=$(python3 -c 'import json, sys; print(json.loads(sys.argv[1])["steps"])' "$SUMMARY")
log "stack run: $RUN_STEPS steps, params_sha256 $SHA"
[[ $RUN_STEPS == "$STEPS" ]] || die "the run ended at step $RUN_STEPS, not $STEPS"
[[ $SHA == "$REF_SHA" ]] || die "params_sha256 differs from the fault-free reference: $SHA != $REF_SHA"
# every CMEMI service ends with a completed task (exit 0, not restarted)
all_done() {
    local svc
    for svc in coordinator aggregator checkpointer worker; do [[ -z $(tasks_of $svc) ]] || return 1; done
}
wait_for "every CMEMI service's tasks to exit" 180 all_done
for svc in coordinator aggregator checkpointer; do
    state=$(docker service ps --format '{{.CurrentState}}' "${STACK}_$svc" | head -1)
    [[ $state == Complete* ]] || die "$svc's last task: $state (expected Complete)"
done
completed=$(docker service ps --format '{{.CurrentState}}' "${STACK}_worker" | grep -c '^Complete' || true)
(( completed >= 3 )) || die "$completed worker tasks completed, expected 3: $(docker service ps "${STACK}_worker")"
MODEL_BYTES=$(run_file model.safetensors | wc -c)   # wc reads it all: `head -c 1` would SIGPIPE the reader under pipefail
(( MODEL_BYTES > 0 )) || die "no final model in the run volume"
log "params_sha256 matches the fault-free reference (scaled 2 -> 3 workers, one killed at step $KILL_STEP)"
phase_done

phase "sharded: docker/stack.shards.yml, shard 1 killed mid-run"
# The same run with cluster.shards: 2 in a stack of its own: swarm restarts the killed shard's task, which
# restores its last checkpoint and replays its step log (docs/design/step-log.md), and the result is still the
# reference's.
timeout 120 docker stack rm "$STACK" >/dev/null 2>&1 || die "docker stack rm $STACK failed"
wait_for "the first stack's containers to go" 180 sh -c "[ -z \"\$(docker ps -aq --filter label=com.docker.stack.namespace=$STACK)\" ]"
docker volume ls -q --filter "label=com.docker.stack.namespace=$STACK" | xargs -r docker volume rm -f >/dev/null 2>&1
STACK=$STACK-k2   # cleanup() removes this one now
VOLUME=${STACK}_runs
python3 "$REPO/scripts/test_overrides.py" "$WORK/stack.test.yml" "$CONFIG" --stack --shards -- "${OVERRIDES[@]}"
CMEMI_IMAGE=$IMAGE REDIS_IMAGE=$IMAGE CMEMI_CONFIG=$CONFIG CMEMI_WORKERS=2 timeout 300 \
    docker stack deploy --resolve-image never -c "$REPO/docker/stack.yml" -c "$REPO/docker/stack.shards.yml" \
    -c "$WORK/stack.test.yml" "$STACK" >"$WORK/deploy.log" 2>&1 || { cat "$WORK/deploy.log" >&2; die "docker stack deploy (sharded) failed"; }
wait_for "the redis task" 300 sh -c "[ -n \"\$(docker ps -q --filter label=com.docker.swarm.service.name=${STACK}_redis --filter status=running)\" ]"
wait_for "both workers to train with 2 shards (live_workers=2)" 300 live_workers 2
own_secrets shard1 "aggregator.key_secret server.key_secret "
wait_step $((STEPS / 4)) 300
VICTIM=$(tasks_of shard1 | head -1)
[[ -n $VICTIM ]] || die "no running shard1 task"
docker kill "$VICTIM" >/dev/null || die "docker kill (shard1) failed"
KILL_STEP=$(progress step)
log "docker kill shard1's task at step $KILL_STEP of $STEPS"
(( KILL_STEP < STEPS )) || die "the run ended before the kill: raise CMEMI_SWARM_STEPS"
shard_restarted() { run_file events.jsonl | grep -q '"kind": "shard_restarted"'; }
wait_for "swarm to restart shard 1 and the leader to take it back" 180 shard_restarted
wait_step "$STEPS" 900
wait_for "run state completed" 120 run_completed
SUMMARY=$(run_file summary.json) || die "no summary.json in the sharded run's volume"
read -r SHA RUN_STEPS SHARDS < <(python3 -c 'import json, sys; s = json.loads(sys.argv[1])
print(s["params_sha256"], s["steps"], len(s.get("shards", [])))' "$SUMMARY")
log "sharded stack run: $RUN_STEPS steps, $SHARDS shards, params_sha256 $SHA"
[[ $RUN_STEPS == "$STEPS" && $SHARDS == 2 ]] || die "the sharded run ended at step $RUN_STEPS with $SHARDS shards"
[[ $SHA == "$REF_SHA" ]] || die "sharded params_sha256 differs from the reference: $SHA != $REF_SHA"
log "params_sha256 matches the reference with 2 shards (shard 1's task killed at step $KILL_STEP)"
phase_done
