#!/bin/sh
# `pip install "$@"` inside infra/Dockerfile's build, where this folder is bind-mounted at /build-host:
# with the host's CA bundle and local wheels when scripts/compose/build-host.sh put them here.
set -eu
if [ -f /build-host/ca-certificates.crt ]; then export PIP_CERT=/build-host/ca-certificates.crt; fi
if [ -d /build-host/wheels ]; then export PIP_FIND_LINKS=/build-host/wheels; fi
exec pip install "$@"
