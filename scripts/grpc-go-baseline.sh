#!/usr/bin/env bash
# Builds the agent-memory benchmark's baseline (bench/grpc-go/main.go) with Debian's Go and
# grpc-go, installing them if missing, into target/grpc-go-baseline/server; prints its path.
# No module download: the packages live in Debian's GOPATH (/usr/share/gocode).
set -euo pipefail
cd "$(dirname "$0")/.."

as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

if ! command -v go >/dev/null 2>&1 || [ ! -d /usr/share/gocode/src/google.golang.org/grpc ] \
   || [ ! -d /usr/share/gocode/src/github.com/golang/protobuf/ptypes/empty ]; then
  echo "grpc-go-baseline: installing Debian's Go and grpc-go" >&2
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
    golang-go golang-google-grpc-dev >/dev/null
fi

out=target/grpc-go-baseline
work="$out/gopath/src/shepherd.invalid/grpc-go-baseline"
mkdir -p "$work"
cp bench/grpc-go/main.go "$work/main.go"
(
  cd "$work"
  GO111MODULE=off GOPATH="$PWD/../../..:/usr/share/gocode" GOCACHE="$PWD/../../../cache" \
    GOFLAGS= go build -o ../../../../server .
)
echo "$out/server"
