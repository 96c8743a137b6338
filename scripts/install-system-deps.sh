#!/usr/bin/env bash
# System packages the tests need (Debian): `prometheus` (a real server scrapes /metrics), `chromium` (the
# dashboard test drives it through Playwright, which never downloads a browser of its own) and `libssl-dev` (the
# scheduler's native fast path hashes KV blocks with OpenSSL's SHA-256). Idempotent: nothing is installed when all
# three are there; `apt-get update` runs only when a package is missing. Needs root (CI is).
set -euo pipefail

missing=()
command -v prometheus >/dev/null 2>&1 || missing+=(prometheus)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
[ -f /usr/include/openssl/sha.h ] || missing+=(libssl-dev)
if [ ${#missing[@]} -eq 0 ]; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "install-system-deps: need root to apt-get install ${missing[*]} (or install them yourself)" >&2
    exit 1
fi
echo "install-system-deps: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# --no-install-recommends: prometheus would otherwise pull exporters and services the tests do not use.
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
