# Sourced by docker/Dockerfile before each pip install in the build stage: use the optional,
# machine-specific files of docker/context/ (copied to /tmp/docker-context/) when they are there.
ctx=/tmp/docker-context
if [ -f "$ctx/ca-certificates.crt" ]; then
    export PIP_CERT="$ctx/ca-certificates.crt" SSL_CERT_FILE="$ctx/ca-certificates.crt"
fi
if [ -f "$ctx/pip.conf" ]; then
    export PIP_CONFIG_FILE="$ctx/pip.conf"
fi
if ls "$ctx"/*.whl >/dev/null 2>&1; then
    export PIP_FIND_LINKS="$ctx"
fi
set -eu
