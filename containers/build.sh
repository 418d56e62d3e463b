#!/usr/bin/env bash
# Build (and with --push, push) refinery's SDK-harness images.
#   containers/build.sh REGISTRY [TAG] [--push] [--cpu-only|--gpu-only]
# REGISTRY e.g. us-central1-docker.pkg.dev/PROJECT/REPO (Artifact Registry) or registry.local:5000.
# TAG defaults to the short git commit. BEAM_VERSION defaults to the apache-beam installed in
# the python found on PATH (the one that will submit jobs): the images must match it.
set -euo pipefail
cd "$(dirname "$0")/.."
registry="${1:?usage: containers/build.sh REGISTRY [TAG] [--push] [--cpu-only|--gpu-only]}"; shift
tag="$(git rev-parse --short HEAD 2>/dev/null || echo dev)"
if [[ $# -gt 0 && "$1" != --* ]]; then tag="$1"; shift; fi
push=0; kinds="cpu gpu"
for a in "$@"; do
  case "$a" in
    --push) push=1 ;;
    --cpu-only) kinds="cpu" ;;
    --gpu-only) kinds="gpu" ;;
    *) echo "unknown option $a" >&2; exit 2 ;;
  esac
done
beam="${BEAM_VERSION:-$(python -c 'import apache_beam; print(apache_beam.__version__)')}"
for kind in $kinds; do
  image="$registry/refinery-$kind:$tag"
  echo "building $image (apache-beam $beam)"
  DOCKER_BUILDKIT=1 docker build -f "containers/Dockerfile.$kind" --build-arg "BEAM_VERSION=$beam" -t "$image" .
  if [[ $push == 1 ]]; then docker push "$image"; fi
  echo "$image"
done
