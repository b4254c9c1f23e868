#!/usr/bin/env bash
# Build (once, cached by version) the real servers: `build.sh [kafka|weaviate|ollama|dgraph|all]...`.
# Each build prints nothing on success when it is already cached; failures leave a note in $STACK_CACHE/failed/.
set -euo pipefail
# shellcheck source=common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"

kafka_dir() { echo "$STACK_CACHE/kafka-$KAFKA_VERSION"; }
weaviate_bin() { echo "$STACK_CACHE/bin/weaviate-$WEAVIATE_VERSION/weaviate-server"; }
ollama_bin() { echo "$STACK_CACHE/bin/ollama-$OLLAMA_VERSION-simd-$(simd_tag)/ollama"; }

# simd_tag: 8 hex digits naming $OLLAMA_SIMD_FLAGS and what they enable on this CPU with this C compiler (its
# -march, -mtune and each -m<feature>), so a change of flags, CPU kind or compiler means a new Ollama binary and
# new cgo objects in Go's build cache (which keys objects by flag strings, not by what -march=native resolves to).
simd_tag() {
    local flags
    read -ra flags <<<"$OLLAMA_SIMD_FLAGS"
    { echo "$OLLAMA_SIMD_FLAGS"; "${CC:-gcc}" "${flags[@]}" -Q --help=target 2>&1; } | cksum |
        { read -r sum _ && printf '%08x\n' "$sum"; }
}
dgraph_bin() { echo "$STACK_CACHE/bin/dgraph-$DGRAPH_VERSION/dgraph"; }

# The broker jars (kafka.Kafka, kafka.tools.StorageTool) and their runtime dependencies, with log4j2 behind
# slf4j 1.x, resolved by Maven from a generated pom; the classpath file points into a Maven repository under the
# cache, so nothing is copied twice.
build_kafka() {
    local dir
    dir=$(kafka_dir)
    [[ -s $dir/classpath.txt ]] && return 0
    mkdir -p "$dir"
    cat >"$dir/pom.xml" <<POM
<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>memstream</groupId><artifactId>kafka-runtime</artifactId><version>1</version><packaging>pom</packaging>
  <dependencies>
    <dependency><groupId>org.apache.kafka</groupId><artifactId>kafka_2.13</artifactId><version>$KAFKA_VERSION</version></dependency>
    <dependency><groupId>org.apache.logging.log4j</groupId><artifactId>log4j-slf4j-impl</artifactId><version>2.24.3</version></dependency>
    <dependency><groupId>org.apache.logging.log4j</groupId><artifactId>log4j-core</artifactId><version>2.24.3</version></dependency>
  </dependencies>
</project>
POM
    say "resolving Apache Kafka $KAFKA_VERSION from Maven Central"
    timed "kafka-$KAFKA_VERSION" "${NICE[@]}" mvn -q -B -f "$dir/pom.xml" -Dmaven.repo.local="$STACK_CACHE/m2" \
        dependency:build-classpath -Dmdep.includeScope=runtime -Dmdep.outputFile="$dir/classpath.tmp" >&2
    mv "$dir/classpath.tmp" "$dir/classpath.txt"
}

# go_build NAME BIN PACKAGE@VERSION [env...]: `go install` into the binary's own folder; a failure is noted.
go_build() {
    local name=$1 bin=$2 pkg=$3
    shift 3
    [[ -x $bin ]] && return 0
    mkdir -p "$(dirname "$bin")" "$STACK_CACHE/failed"
    say "building $name: go install $pkg (minutes, once)"
    local log="$STACK_CACHE/failed/$name.log"
    if timed "$name" env GOBIN="$(dirname "$bin")" "$@" "${NICE[@]}" go install "$pkg" >"$log" 2>&1; then
        rm -f "$log"
    else
        say "$name build failed (go install $pkg); last lines of $log:"
        tail -n 5 "$log" >&2
        return 1
    fi
}

build_weaviate() {
    go_build weaviate "$(weaviate_bin)" "github.com/weaviate/weaviate/cmd/weaviate-server@$WEAVIATE_VERSION" CGO_ENABLED=0
}

# Headers that Ollama's copy of llama.cpp keeps in vendor/ folders, which Go module zips leave out: nlohmann/json
# and stb_image from Debian's packages (downloaded and unpacked, not installed), miniaudio.h from the source
# distribution of the PyPI package miniaudio (hash-pinned).
ollama_headers() {
    local dir=$STACK_CACHE/ollama-headers
    [[ -f $dir/.complete ]] && { echo "$dir"; return 0; }
    local tmp=$dir.tmp deb
    rm -rf "$tmp" && mkdir -p "$tmp/deb" "$tmp/root" "$tmp/sdist" "$tmp/include/miniaudio" || return 1
    say "fetching the headers Ollama's module zip lacks (Debian nlohmann-json3-dev, libstb-dev; PyPI miniaudio)"
    # a new machine may have no package lists yet: update once, then retry
    (cd "$tmp/deb" && apt-get download "${OLLAMA_DEBS[@]}" >&2 2>/dev/null) ||
        { apt-get update -qq >&2 && (cd "$tmp/deb" && apt-get download "${OLLAMA_DEBS[@]}" >&2); } || return 1
    for deb in "$tmp"/deb/*.deb; do dpkg-deb -x "$deb" "$tmp/root" || return 1; done
    cp -r "$tmp/root/usr/include/nlohmann" "$tmp/root/usr/include/stb" "$tmp/include/" || return 1
    "${NICE[@]}" python3 -m pip download --quiet --no-deps --no-binary :all: --require-hashes --dest "$tmp/sdist" \
        -r /dev/stdin <<<"miniaudio==$MINIAUDIO_VERSION --hash=sha256:$MINIAUDIO_SHA256" >&2 || return 1
    tar -xzf "$tmp/sdist/miniaudio-$MINIAUDIO_VERSION.tar.gz" -C "$tmp/sdist" &&
        cp "$tmp/sdist/miniaudio-$MINIAUDIO_VERSION/miniaudio/miniaudio.h" "$tmp/include/miniaudio/" || return 1
    rm -rf "$dir" && mv "$tmp/include" "$dir" && rm -rf "$tmp" && touch "$dir/.complete" || return 1
    echo "$dir"
}

build_ollama() {
    [[ -x $(ollama_bin) ]] && return 0
    local headers
    headers=$(ollama_headers) || { say "ollama: could not fetch the vendored headers"; return 1; }
    local tag simd
    tag=$(simd_tag)
    # CGO_CFLAGS/CGO_CXXFLAGS reach every cgo package, ggml-cpu included (its own `#cgo CFLAGS` add only -O3 for C,
    # after these); the unused macro puts the tag into Go's build cache keys
    simd="$OLLAMA_SIMD_FLAGS -DMEMSTREAM_SIMD_TAG=$tag"
    say "ollama: ggml CPU kernels built with $OLLAMA_SIMD_FLAGS (tag $tag)"
    go_build ollama "$(ollama_bin)" "github.com/ollama/ollama@$OLLAMA_VERSION" CGO_ENABLED=1 CGO_CPPFLAGS="-I$headers" \
        CGO_CFLAGS="$simd" CGO_CXXFLAGS="$simd"
}
# Dgraph: `go install module/dgraph@version` fails here because the module proxy refuses the module's version
# list (403), which `go install` reads for deprecations, but it serves the v25.3.8 zip. So: download that zip with
# `go mod download` and build the command inside it, as its own main module (its go.mod has no replace
# directives; every dependency comes from the proxy).
build_dgraph() {
    local bin dir log=$STACK_CACHE/failed/dgraph.log
    bin=$(dgraph_bin)
    [[ -x $bin ]] && return 0
    mkdir -p "$STACK_CACHE/failed"
    say "building dgraph $DGRAPH_VERSION (minutes, once)"
    if dir=$(go mod download -json "github.com/dgraph-io/dgraph/v25@$DGRAPH_VERSION" 2>"$log" |
        python3 -c 'import json, sys; print(json.load(sys.stdin)["Dir"])' 2>>"$log") &&
        (cd "$dir" && timed "dgraph-$DGRAPH_VERSION" env CGO_ENABLED=0 "${NICE[@]}" go build -o "$bin" \
            -ldflags "-X github.com/dgraph-io/dgraph/v25/x.dgraphVersion=$DGRAPH_VERSION" ./dgraph) >>"$log" 2>&1; then
        rm -f "$log"
    else
        say "dgraph build failed; last lines of $log:"
        tail -n 5 "$log" >&2
        return 1
    fi
}

main() {
    local targets=("$@") status=0
    ((${#targets[@]})) || targets=(all)
    [[ ${targets[0]} == all ]] && targets=(kafka weaviate ollama dgraph)
    for target in "${targets[@]}"; do
        case $target in
        kafka | weaviate | ollama | dgraph) "build_$target" || status=1 ;;
        *) die "unknown component $target (kafka, weaviate, ollama, dgraph)" ;;
        esac
    done
    return $status
}

if [[ ${BASH_SOURCE[0]} == "$0" ]]; then main "$@"; fi
