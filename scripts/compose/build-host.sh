# shellcheck shell=bash
# Fill infra/compose/build-host/ (bind-mounted by infra/Dockerfile's pip steps, never copied into the
# image) with this machine's pip set-up, sourced by scripts/compose/test.sh: its CA bundle (registry
# traffic goes through a TLS-re-signing proxy whose CA only the host trusts) and its local wheels
# (pip's find-links: torch's CPU build, which PyPI does not have).

build_host_fill() {
  local dir=infra/compose/build-host pip=${PIP:-.venv/bin/pip} cert links
  cert=${PIP_CERT:-$("$pip" config get global.cert 2>/dev/null || true)}
  cert=${cert:-/etc/ssl/certs/ca-certificates.crt}
  rm -rf "$dir/wheels" "$dir/ca-certificates.crt"
  if [[ -f "$cert" ]]; then
    cp "$cert" "$dir/ca-certificates.crt"
  fi
  links=${PIP_FIND_LINKS:-$("$pip" config get global.find-links 2>/dev/null || true)}
  if [[ -n "$links" && -d "$links" ]]; then
    mkdir -p "$dir/wheels"
    # A hard link where the file system allows it: the wheels are large (torch's is 180 MB).
    cp -l "$links"/*.whl "$dir/wheels/" 2>/dev/null || cp "$links"/*.whl "$dir/wheels/"
  fi
  echo "build host: CA bundle ${cert}, wheels from ${links:-(none)}: $(ls "$dir/wheels" 2>/dev/null | tr '\n' ' ')"
}
