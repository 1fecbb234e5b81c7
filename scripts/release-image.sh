#!/usr/bin/env bash
# The agent's image, built, pushed and pinned: the one way a release reaches deploy/ (CI runs it on a tag too).
#
#   scripts/release-image.sh IMAGE [--destination TRANSPORT:REF] [--base IMAGE] [--deploy DIR] [--no-pin]
#   scripts/release-image.sh pin IMAGE DIGEST [--deploy DIR]
#
# IMAGE is the repository you push to, fully qualified: REGISTRY/PATH (e.g. ghcr.io/acme/ipmasq, or your
# registry's host and port). The first form:
#   1. builds the Dockerfile with podman, tagged IMAGE:VERSION (VERSION: ipmasq.__version__, the one place the release
#      is written), with the OCI labels source, version and revision (the checkout's commit, `-dirty` when it has
#      uncommitted changes, which the image's `ipmasq --version` prints too);
#   2. pushes it (default docker://IMAGE:VERSION; --destination names any other podman destination, e.g.
#      oci:/tmp/out:VERSION or dir:/tmp/out to try it without a registry) and reads the digest pushed;
#   3. pins deploy/ to it: the `images:` entry of deploy/base and deploy/webhook gets newName IMAGE, newTag VERSION
#      and digest sha256:..., so `kubectl apply -k deploy/` runs exactly the image pushed, and a rebuild under the same
#      tag (a new digest) rolls out. --no-pin leaves deploy/ as it is.
# The second form is step 3 alone, for an image pushed some other way.
#
# The build reaches the package index the way this machine does (the lab's image build does the same, see
# src/ipmasq/lab/kubernetes/artifacts.py): the host's network and, when present, its CA bundle, mounted for the build
# only. podman log in to the registry first (podman login REGISTRY).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

usage() {
  sed -n '3,5p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}
# one line, whatever a value holds: what is not printable (a newline, an escape) becomes ?
die() { printf 'release-image: %s\n' "$(printf '%s' "$*" | LC_ALL=C tr -c '[:print:]' '?')" >&2; exit 1; }

# IMAGE must name a registry host: a first path component with a dot or a port, or localhost (a bare `acme/ipmasq`
# is a Docker Hub name the operator may not own)
check_image() {
  local image=$1 host=${1%%/*}
  [[ $image == */* ]] || die "$image: name the registry, e.g. ghcr.io/OWNER/ipmasq"
  [[ $host == *.* || $host == *:* || $host == localhost ]] || die "$image: $host is not a registry host (name it in full, e.g. ghcr.io/$image)"
  [[ $image =~ ^[a-z0-9.:-]+(/[a-z0-9._-]+)+$ ]] || die "$image: not a repository name (lower case, no tag or digest)"
}

check_digest() {
  [[ $1 =~ ^sha256:[0-9a-f]{64}$ ]] || die "$1: not a digest (sha256: and 64 hex digits)"
}

version() {
  sed -n 's/^__version__ = "\([^"]*\)".*/\1/p' "$root/src/ipmasq/__init__.py"
}

# Every kustomization under DIR whose `images:` names the agent's image (deploy/base, deploy/webhook) gets the entry
# rewritten (the rest of each file, comments included, kept as it is); then kustomize must render the pinned reference
pin() {
  local image=$1 digest=$2 deploy=$3 tag
  check_image "$image"
  check_digest "$digest"
  tag=$(version)
  [ -d "$deploy" ] || die "$deploy: no such directory"
  python3 - "$deploy" "$image" "$tag" "$digest" <<'PY'
import pathlib
import re
import sys

deploy, image, tag, digest = sys.argv[1:]
block = re.compile(r"^images:\n(?:[ \t].*\n|\n)*", re.MULTILINE)
entry = f'images:\n  - name: ipmasq\n    newName: {image}\n    newTag: "{tag}"\n    digest: {digest}\n'
pinned = []
for path in sorted(pathlib.Path(deploy).rglob("kustomization.yaml")):
    text = path.read_text(encoding="utf-8")
    found = block.findall(text)
    if not any(re.search(r"^\s*- name: ipmasq\s*$", b, re.MULTILINE) for b in found):
        continue
    if len(found) != 1:
        sys.exit(f"release-image: {path}: expected one top-level `images:` list")
    path.with_name(path.name + ".new").write_text(block.sub(lambda _m: entry, text), encoding="utf-8")
    path.with_name(path.name + ".new").replace(path)
    pinned.append(str(path))
if not pinned:
    sys.exit(f"release-image: no kustomization under {deploy} names the image ipmasq")
print("\n".join(pinned))
PY
  if command -v kubectl >/dev/null 2>&1; then
    for dir in "$deploy" "$deploy/webhook"; do
      [ -f "$dir/kustomization.yaml" ] || continue
      kubectl kustomize "$dir" | grep -qF "image: $image:$tag@$digest" \
        || die "kubectl kustomize $dir does not render $image:$tag@$digest"
    done
  fi
  echo "release-image: $deploy runs $image:$tag@$digest"
}

if [ "${1:-}" = pin ]; then
  shift
  [ $# -ge 2 ] || usage
  image=$1 digest=$2 deploy=$root/deploy
  shift 2
  while [ $# -gt 0 ]; do
    case $1 in
      --deploy) deploy=${2:?--deploy needs a directory}; shift 2 ;;
      *) usage ;;
    esac
  done
  pin "$image" "$digest" "$deploy"
  exit 0
fi

[ $# -ge 1 ] && [[ $1 != -* ]] || usage
image=$1
shift
destination="" base="" deploy=$root/deploy do_pin=1
while [ $# -gt 0 ]; do
  case $1 in
    --destination) destination=${2:?--destination needs TRANSPORT:REF}; shift 2 ;;
    --base) base=${2:?--base needs an image}; shift 2 ;;
    --deploy) deploy=${2:?--deploy needs a directory}; shift 2 ;;
    --no-pin) do_pin=0; shift ;;
    *) usage ;;
  esac
done
check_image "$image"
command -v podman >/dev/null 2>&1 || die "podman is missing (apt-get install podman)"
tag=$(version)
[ -n "$tag" ] || die "src/ipmasq/__init__.py: no __version__"
revision=$(git -C "$root" rev-parse HEAD 2>/dev/null || echo unknown)
if [ "$revision" != unknown ] && [ -n "$(git -C "$root" status --porcelain --untracked-files=no 2>/dev/null)" ]; then
  revision=$revision-dirty
fi
source_url=${IPMASQ_SOURCE_URL:-https://github.com/ipmasq/ipmasq}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
build=(podman build --network=host -f "$root/Dockerfile" -t "$image:$tag"
       --build-arg "VERSION=$tag" --build-arg "REVISION=$revision" --build-arg "SOURCE=$source_url")
[ -z "$base" ] || build+=(--build-arg "BASE=$base")
if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
  printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' >"$work/pip.conf"
  build+=(-v "$work/pip.conf:/etc/pip.conf:ro" -v /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro)
fi
echo "release-image: building $image:$tag (revision $revision)" >&2
"${build[@]}" "$root" >&2

destination=${destination:-docker://$image:$tag}
echo "release-image: pushing to $destination" >&2
podman push --quiet --digestfile "$work/digest" "$image:$tag" "$destination" >&2
digest=$(cat "$work/digest")
check_digest "$digest"
echo "release-image: pushed $image:$tag as $digest" >&2
if [ "$do_pin" = 1 ]; then
  pin "$image" "$digest" "$deploy"
else
  echo "$image:$tag@$digest"
fi
