"""The settings schema of every zmqllm process: one dataclass per section of the TOML file.

A file has one table per section (``[model]``, ``[broker]``, ``[worker]``, ``[gateway]``,
``[log]``, ``[security]``) plus an array of ``[[stages]]`` tables for the launcher. Every
key has a default, so a file only names what it changes, and every key has a command-line
flag (flags.py) that overrides the file through ``with_overrides``. Mistakes
are reported as ``ConfigError`` naming the key, the section and the file, because a typo
that silently falls back to a default is the hardest kind of misconfiguration to spot in
a cluster of processes.

This module holds the sections (each setting once, with its help); ``paths.py`` says where
models and logs live and what a model is called, ``loading.py`` reads a file and flags into
the sections, checking every value, and ``layers.py`` parses layer specs.

This module runs in the broker and the gateway, so it must not import torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from zmqllm.log import LOG_FORMATS, LOG_LEVELS

__all__ = [
    "BrokerSettings",
    "Config",
    "ConfigError",
    "GatewaySettings",
    "LogSettings",
    "ModelSettings",
    "RaySettings",
    "RemoteSpec",
    "SecuritySettings",
    "StageSpec",
    "WorkerSettings",
    "setting",
]

DTYPES = ("float32", "bfloat16", "float16")
QUANTS = ("none", "int8", "int4")  # engine/quant.py
WIRE_DTYPE_CHOICES = ("auto", *DTYPES)  # "auto": activations travel in the model's dtype
KV_DTYPE_CHOICES = ("auto", "float32", "bfloat16")  # "auto": the model's dtype
# engine/prompt_lookup.py (lookup) and engine/draft.py (a draft model).
SPECULATIVE_CHOICES = ("auto", "off", "lookup", "draft")
MAX_DRAFT_TOKENS = 16  # bus/messages.py's, the most proposals a STEP carries
DEFAULT_MODEL = "default"
TINY_MODEL = "tiny"


class ConfigError(ValueError):
    """A config file, a flag or a layer spec that cannot be used as given."""


# --- sections ---------------------------------------------------------------------------
#
# Every setting is declared once, here: its default and the help text of its flag.
# zmqllm/config/flags.py makes the command-line flags from these fields, so a new field
# gets its flag (``--field-name``) without touching the command line.

_T = TypeVar("_T")


def setting(
    default: _T,
    help: str,
    *,
    flag: str | None = None,
    metavar: str | None = None,
    choices: Sequence[str] | None = None,
) -> _T:
    """A settings field: its default and its flag's help text.

    ``flag`` replaces the generated ``--field-name`` (``--model`` for ``[model] path``);
    ``metavar`` names the value in ``--help``; ``choices`` lists the values the section's
    check accepts, so argparse refuses others before anything starts.
    """
    metadata = {
        "help": help,
        "flag": flag,
        "metavar": metavar,
        "choices": tuple(choices) if choices is not None else None,
    }
    return field(default=default, metadata=metadata)


@dataclass
class ModelSettings:
    # "default" and "tiny" are resolved by paths.resolve_model_path.
    path: str = setting(
        DEFAULT_MODEL,
        '"default", "tiny", a checkpoint directory or a Hugging Face repo id',
        flag="--model",
        metavar="MODEL",
    )
    revision: str | None = setting(None, "Hub revision (branch, tag or commit)", metavar="REV")
    dtype: str = setting("float32", "dtype of weights and activations", choices=DTYPES)
    device: str = setting("cpu", '"cpu", "cuda" or "cuda:N"')
    quant: str = setting(
        "none",
        "weights of the matmuls: int8 or int4 in blocks of 32 with a scale and a minimum each "
        "(a model prepared from a Q4_1 GGUF loads its blocks as they are); float32 on the cpu",
        choices=QUANTS,
    )
    name: str = setting(
        "",
        "model name served by the OpenAI API; empty = derived from the path",
        flag="--model-name",
        metavar="NAME",
    )


@dataclass
class BrokerSettings:
    frontend: str = setting(
        "tcp://127.0.0.1:5555", "bind address for gateways and clients", metavar="ADDR"
    )
    backend: str = setting("tcp://127.0.0.1:5556", "bind address for workers", metavar="ADDR")
    heartbeat_interval: float = setting(1.0, "seconds between heartbeats")
    heartbeat_liveness: int = setting(3, "missed heartbeats before a peer counts as dead")
    queue_size: int = setting(256, "sessions waiting for a route")
    queue_timeout: float = setting(30.0, "seconds a session may wait for a route")
    # A lost message must not hold a slot or a KV reservation. Longer than the longest
    # forward: a 2048-token prefill of a 7B model on a CPU.
    session_timeout: float = setting(
        120.0,
        "seconds a session may go without any message from its route before it is "
        "failed and freed everywhere",
    )
    # The activations of a prefill chunk: prefill_chunk x hidden x 4 bytes for fp32.
    max_message_bytes: int = setting(
        256 << 20, "largest message on the backend; ZeroMQ disconnects a peer sending more"
    )
    # An OPEN carries 4 bytes per prompt token.
    frontend_max_message_bytes: int = setting(16 << 20, "largest message on the frontend")
    # Its sessions fail (slow_consumer) instead of the broker waiting for it.
    peer_queue: int = setting(
        10000, "messages queued to one client before it counts as not reading"
    )
    # Larger: a worker takes a burst of one message per session it serves at every step.
    worker_queue: int = setting(100000, "messages queued to one worker before it counts as lost")
    max_workers: int = setting(1024, "most workers registered at once; past it REGISTER fails")
    max_ranges: int = setting(
        512, "most distinct layer ranges (pools) at once; past it REGISTER fails"
    )
    # SGLang's router balances the same way: cache affinity while loads are close.
    affinity_slack: int = setting(
        4,
        "a session follows its cached prompt prefix to a replica with at most this many "
        "more sessions than the least busy one of its layer range; past that, load decides",
    )
    # Long enough for a worker to load the range it was given and register.
    place_hold: float = setting(
        300.0,
        "seconds a range given to a worker started with --layers auto counts as served "
        "(so that workers starting together fill different gaps) until it registers",
    )
    # Discovery finds the address only: a worker checks the announced key against its own
    # copy of the broker's key (bus/discovery.py).
    announce: bool = setting(
        False,
        "advertise the backend on the local network by mDNS/DNS-SD (_zmqllm._tcp), with "
        "the broker's public key and the models served, for `zmqllm worker --discover`; "
        "needs CURVE keys and a backend other machines can reach",
    )
    model_fingerprint: str = setting(
        "",
        "admit only workers of the model with this digest (sent in REGISTER), even into an "
        "empty cluster; empty = the first worker defines the model until the last leaves",
        metavar="DIGEST",
    )


# A ticket (`zmqllm ticket` on the broker's host) is a secret: @FILE or stdin keep it out
# of `ps` and shell history.
_JOIN_HELP = (
    "join the broker with a ticket from `zmqllm ticket` on its host: the ticket, @FILE "
    "holding it, or - to read it from stdin; its keys are stored under "
    "$ZMQLLM_HOME/tickets/NAME and its broker{what} used unless flags say otherwise"
)


@dataclass
class WorkerSettings:
    broker: str = setting("tcp://127.0.0.1:5556", "the broker's backend address", metavar="ADDR")
    join: str = setting("", _JOIN_HELP.format(what=", model and layers are"), metavar="TICKET")
    discover: bool = setting(
        False,
        "find the broker on the local network by mDNS (one started with --announce) instead "
        "of --broker; an announcement is used only when its public key is the broker key of "
        "this worker's --keys or ticket (prefers a broker already serving --model)",
    )
    discover_timeout: float = setting(
        10.0, "seconds --discover waits for an announcement with the trusted key before exiting 2"
    )
    # Activations and next steps then go from worker to worker: the broker forwards only
    # the tokens.
    peer: str = setting(
        "auto",
        "direct links to the workers beside this one on its routes: auto (loopback when the "
        "broker is local, else the address towards it, with CURVE keys only), off, or the "
        "tcp://HOST:PORT to bind (PORT * = any)",
        metavar="ENDPOINT",
    )
    layers: str = setting(
        "",
        'half-open layer range "0:15", stage "1/2" (stages of about equal cost: the last '
        'one also runs the output layer), "" for all layers, or "auto": measure this '
        "machine, then load the range the broker answers (the first layers no worker "
        "serves, else the pool with the least throughput for its load, within memory)",
        metavar="SPEC",
    )
    threads: int = setting(0, "torch CPU threads; 0 = torch's default")
    # Stages sharing the cores all compute at once then, and oversubscribed OpenMP is far
    # slower.
    batch_threads: int = setting(
        0, "torch CPU threads while several sessions are in flight; 0 = threads"
    )
    # Stages sharing the cores take turns with all their threads instead of
    # oversubscribing them.
    cpu_lock: str = setting(
        "",
        "lock file shared by the workers of one machine, held by each forward; empty = off",
        metavar="FILE",
    )
    # Stage 0 splits each route's sessions so that every stage computes one group while
    # the others compute the rest. Stages taking turns on shared cores gain nothing from
    # that, and one batch of all rows costs less than two of half (docs/pipeline.md).
    micro_batches: int = setting(
        0,
        "groups of sessions in flight on each route, formed by stage 0: 0 = one per stage "
        "of the route, or 1 with cpu_lock; N = at most N (1: all sessions in one group)",
    )
    native_attention: bool = setting(
        True,
        "attend batched decode steps with the compiled kernel (zmqllm/engine/csrc, built on "
        "first use; float32 on the CPU only); off, or no compiler: the PyTorch path",
    )
    # Off: every row count keeps the 16-bit integer paths, so a session's numbers do not
    # depend on how many others share its forward (docs/scale.md, "Many rows").
    matrix_units: bool = setting(
        True,
        "int8/int4 products of 8 rows or more (12 with AMX: batched decode, prefill) in "
        "bfloat16 on the CPU's matrix units (AMX, or AVX512_BF16), where the CPU has them",
    )
    # Off by default: 8-bit steps move the default model's logits ~5 % of the largest
    # (bfloat16: ~1 %) and change its greedy text on the test prompts (docs/scale.md).
    int8_activations: bool = setting(
        False,
        "int8/int4 products of 5 to 47 rows (of 5 and more without AMX) with activations "
        "quantized to int8 per block of 32, on AVX-512 VNNI (llama.cpp's numbers; 1.5x "
        "faster at 16 rows); needs matrix_units",
    )
    # Faster batched decode, at the cost of a second copy of the weights.
    packed_rows: int = setting(
        16,
        "keep an MKL-packed copy of the weights for batches of 7 to N rows (float32 on the "
        "CPU only); 0 = off",
    )
    max_sessions: int = setting(64, "sessions served at once")
    max_kv_tokens: int = setting(
        0,
        "KV cache tokens reserved by all sessions together; past it new ones are refused "
        "(FULL: the broker tries another replica); 0 = what the memory given holds after "
        "the weights and the runtime, less a margin (10%, at least 256 MiB)",
    )
    max_memory_mb: int = setting(
        0,
        "the memory given to this stage: it refuses to start when its weights and KV "
        "budget would not fit, and refuses a new session when the weights, the runtime "
        "and the KV bytes reserved (not RSS: reserved pages are not resident until "
        "written) plus that session's would pass it; 0 = what the machine (or cgroup, or "
        "GPU) has free at start",
    )
    # As llama.cpp's server: a burst of short prompts prefills in one forward.
    prefill_chunk: int = setting(2048, "prompt tokens per forward", metavar="TOKENS")
    # As vLLM's and SGLang's chunked prefill: while sessions decode, each of their steps
    # waits on the forward, so a long prompt goes in chunks that keep those steps coming.
    busy_prefill_chunk: int = setting(
        256,
        "prompt tokens per forward while other sessions are decoding (at most prefill_chunk)",
        metavar="TOKENS",
    )
    # At many streams batched decode attention reads every session's whole KV each step:
    # bfloat16 halves those bytes (as vLLM's CPU backend keeps its cache); off by default
    # because it rounds every key and value once (docs/configuration.md, "kv_dtype").
    kv_dtype: str = setting(
        "auto",
        'dtype of the KV cache: "auto" = the model\'s dtype; bfloat16 with a float32 model '
        "halves the cache's bytes (twice the sessions or context in the same memory) and "
        "what batched decode attention reads, at the cost of rounding keys and values",
        choices=KV_DTYPE_CHOICES,
    )
    # Multi-turn chat resends the conversation each turn: kept, its KV is not recomputed.
    prefix_cache: bool = setting(
        True,
        "keep the KV of recent prompts' prefixes (16-token blocks, least recently used "
        "dropped first) in the room max_kv_tokens leaves free, and start a prompt after "
        "the part every stage of its route holds",
    )
    # bfloat16 or float16 halves the bytes of a float32 model's activations on a slow
    # link, at the cost of rounding them once per stage boundary.
    wire_dtype: str = setting(
        "auto",
        'dtype of the activations this worker sends; "auto" = the model\'s dtype. A worker '
        "takes activations of any of float32, bfloat16 and float16 and casts them to its own",
        choices=WIRE_DTYPE_CHOICES,
    )
    # Fewer passes per token: across machines a pass costs a crossing of every link. "auto"
    # turns lookup on only where it measures as a gain that cannot change greedy text
    # (docs/configuration.md).
    speculative: str = setting(
        "auto",
        "speculative decoding, on the last stage: auto = lookup where a pass of a few rows "
        "gives each row the bits it gets alone (the compiled kernel on the CPU: float32, "
        "int8, int4), else off; lookup = propose the tokens that followed "
        "the latest occurrence of the text's last tokens in its prompt and output, verified "
        "in the next pass (the same tokens, fewer passes when text repeats); draft = a "
        "draft model (draft_model) on this stage, which must be the last, proposes its "
        "greedy next tokens (the same tokens, fewer passes when the draft guesses right)",
        choices=SPECULATIVE_CHOICES,
    )
    max_draft_tokens: int = setting(
        6, f"the most tokens a session proposes per pass (1 to {MAX_DRAFT_TOKENS})"
    )
    draft_model: str = setting(
        DEFAULT_MODEL,
        'the draft model of speculative = "draft": a directory or Hub repo id of a model '
        'with the served model\'s tokenizer (refused otherwise), or "default" (the default '
        "model, which drafts for any model with its tokenizer); its weights and each "
        "session's draft KV cache are held beside the stage's",
        metavar="MODEL",
    )
    name: str = setting("", "a name for logs and status; empty = HOST-PID")
    served_name: str = setting(
        "",
        "the model name clients ask for; empty = [model] name (or one derived from the "
        "path), or for a remote worker the upstream's model id",
        metavar="NAME",
    )
    # A remote worker runs no layers: no torch, no model files, only an HTTP client.
    remote: str = setting(
        "",
        "serve a whole model by forwarding to this OpenAI-compatible API (its base URL, "
        "e.g. http://host:8000/v1, or @FILE holding it, which keeps it out of `ps`) "
        "instead of running layers; empty = run layers",
        metavar="URL",
    )
    remote_model: str = setting(
        "", "the upstream's model id; empty = the first id URL/models lists", metavar="NAME"
    )
    api_key_file: str = setting(
        "",
        "file holding the upstream's API key (sent as a bearer token, never logged nor sent "
        "to the broker); empty = no key",
        metavar="FILE",
    )
    remote_stall_timeout: float = setting(
        60.0, "seconds an upstream stream may send nothing before its session fails"
    )
    remote_retries: int = setting(
        3, "tries after the first when the upstream cannot be reached before the first piece"
    )


@dataclass
class GatewaySettings:
    host: str = setting("127.0.0.1", "address the HTTP server listens on")
    port: int = setting(8080, "HTTP port; 0 = pick a free port")
    broker: str = setting("tcp://127.0.0.1:5555", "the broker's frontend address", metavar="ADDR")
    join: str = setting("", _JOIN_HELP.format(what=" is"), metavar="TICKET")
    max_body_bytes: int = setting(1_000_000, "largest request body; past it 413")
    default_max_tokens: int = setting(256, "max_tokens of a request that gives none")
    local_model: bool = setting(
        True,
        "serve the [model] model (the gateway reads its tokenizer and config files); off: "
        "serve only the remote (text) models the broker has, with no model files",
    )
    default_model: str = setting(
        "",
        "the model of a request that names none; empty = this gateway's own model, or the "
        "only one served",
        metavar="NAME",
    )
    # As many as one route's worker takes by default (max_sessions).
    max_concurrent: int = setting(
        64, "generations running at once; more wait in the queue, oldest first"
    )
    max_queued: int = setting(1024, "requests waiting for a slot; past it 429 with Retry-After")
    queue_timeout: float = setting(300.0, "seconds a request may wait in the queue; then 503")
    first_token_timeout: float = setting(
        120.0,
        "seconds from leaving the queue to the first token (the broker's queue, the "
        "prefill); then the session is cancelled and the client gets 504",
    )
    inter_token_timeout: float = setting(
        60.0,
        "seconds without a token once streaming; then the session is cancelled and the "
        "stream ends with an error",
    )
    request_timeout: float = setting(600.0, "seconds for a whole generation once out of the queue")
    failover_timeout: float = setting(
        30.0,
        "seconds a stream whose route failed (a worker lost, the broker restarted) has to go "
        "on from another route, which replays its prompt and tokens so far; then it ends "
        "with the error",
    )
    failover_retries: int = setting(
        5, "replays one stream may make in its life; 0 = no failover (a lost route ends it)"
    )
    # Above max_concurrent + max_queued so the queue, not this, is what a burst meets.
    limit_concurrency: int = setting(
        2048, "HTTP connections plus requests in progress past which uvicorn answers 503"
    )
    keep_alive_timeout: int = setting(
        5, "seconds an idle keep-alive connection stays open", metavar="S"
    )
    # Against slowloris.
    header_timeout: float = setting(
        10.0, "seconds for a request's line and headers to arrive; then the connection closes"
    )
    body_timeout: float = setting(30.0, "seconds to read a request's whole body; then 408")
    # The prefix cache's counters say whether a prompt was seen before: shown to clients
    # (/metrics, /cluster/status) only where they are one tenant.
    prefix_stats: bool = setting(
        False,
        "show each worker's prefix cache figures and the work figures a cache hit changes "
        "(tokens, forwards, busy seconds, forward times) in /metrics and /cluster/status; "
        "they tell any client whether another sent a prompt (a guess's hits), so they are "
        "off unless the clients are one tenant (zmqllm status always shows them)",
    )
    # Fair share between API keys (zmqllm/gateway/key_shares.py), with two keys or more.
    key_max_concurrent: int = setting(
        0,
        "generation slots one API key may hold at once, when there are two keys or more "
        "(past it 429); 0 = half of max_concurrent",
        metavar="N",
    )
    key_max_kv_tokens: int = setting(
        0,
        "KV tokens (prompt + max_tokens per choice) one API key may hold reserved, when "
        "there are two keys or more (past it 429); 0 = half of what the model's workers offer",
        metavar="N",
    )
    # Against DNS rebinding and cross-site pages (zmqllm/gateway/browser_guard.py).
    allowed_hosts: str = setting(
        "",
        "comma-separated Host names the gateway answers as ('*' = any); empty = the bind "
        "address, localhost, 127.0.0.1 and ::1 (bound to every interface: also any IP "
        "address and this machine's names); others get 400",
        metavar="HOSTS",
    )
    cors_origins: str = setting(
        "",
        "comma-separated origins (https://app.example.com) whose pages may call the API "
        "from a browser ('*' = any); empty = none: a cross-origin request gets 403",
        metavar="ORIGINS",
    )
    # Against clients that stop reading a stream: each would hold its slots for good.
    write_timeout: float = setting(
        30.0,
        "seconds a response may wait for a client that reads nothing, or that leaves over "
        "max_unread_bytes unread and takes less than that in this time; then the "
        "connection is cut and its generation cancelled",
    )
    # Against clients that read nothing while the kernel's buffers absorb their stream,
    # or read a trickle (zmqllm/gateway/write_progress.py).
    max_unread_bytes: int = setting(
        262_144,
        "bytes of a response a client may leave unread (each connection's kernel send "
        "buffer is sized to it); a client leaving more must take at least this many every "
        "write_timeout, else its connection is cut and its generation cancelled",
        metavar="BYTES",
    )
    api_keys_file: str = setting(
        "",
        "file of API keys, one a line ('#' starts a comment): /chat, /v1/* and /metrics then "
        "need 'Authorization: Bearer KEY'; re-read when it changes. Empty = the "
        "ZMQLLM_API_KEY environment variable if set, else no keys (open)",
        flag="--api-key-file",
        metavar="FILE",
    )
    # As the broker refuses a plaintext bus beyond loopback (zmqllm/gateway/main.py).
    open_api: bool = setting(
        False,
        "serve the API without API keys on an address other than loopback, so that anyone "
        "who reaches it may use it; without this the gateway refuses to start that way",
    )
    ssl_certfile: str = setting(
        "", "serve https with this PEM certificate (chain); empty = http", metavar="FILE"
    )
    ssl_keyfile: str = setting("", "the certificate's private key (PEM)", metavar="FILE")


@dataclass
class SecuritySettings:
    keys: str = setting(
        "",
        "CURVE key folder (made by `zmqllm keys init DIR`); empty = $ZMQLLM_HOME/keys if it "
        "exists, else no keys: the bus is plaintext and the broker binds loopback only",
        metavar="DIR",
    )
    insecure: bool = setting(False, "run without CURVE even where keys exist")


PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")  # Ray's


@dataclass
class RaySettings:
    """`zmqllm ray up|status|down`: the roles as detached actors on a running Ray cluster."""

    address: str = setting(
        "", "the Ray cluster (HOST:PORT of its head); empty = RAY_ADDRESS", metavar="HOST:PORT"
    )
    namespace: str = setting("zmqllm", "the Ray namespace of this cluster's actors")
    strategy: str = setting(
        "PACK",
        "how the stages' bundles are placed: STRICT_SPREAD = each worker on a node of its own",
        choices=PLACEMENT_STRATEGIES,
    )
    front_resource: str = setting(
        "",
        "a custom resource the broker's and gateway's node has; empty = the head node",
        metavar="NAME",
    )
    ready_timeout: float = setting(900.0, "seconds `ray up` waits for a warm-up answer")


@dataclass
class StageSpec:
    layers: str  # same forms as WorkerSettings.layers
    count: int = 1  # replicas of this stage the launcher starts
    # What one replica asks of its node under `zmqllm ray up` (zmqllm/onray/): Ray's CPUs
    # and memory, and disk as the custom resource "disk_bytes" (Ray has none).
    cpus: float = 1.0
    memory: str = ""  # e.g. "16GiB"; "" = nothing asked
    disk: str = ""


@dataclass
class RemoteSpec:
    """A model behind an OpenAI-compatible API that `zmqllm up` serves beside its own
    (remote workers: ``zmqllm worker --remote``)."""

    url: str  # the API's base URL, e.g. "https://api.example.com/v1"
    model: str = ""  # the upstream's model id; "" = the first URL/models lists
    served_name: str = ""  # the name clients ask for; "" = the upstream's id
    api_key_file: str = ""  # the upstream's key; "" = none
    count: int = 1  # remote workers the launcher starts for it


@dataclass
class LogSettings:
    level: str = setting("info", "log level", flag="--log-level", choices=tuple(LOG_LEVELS))
    format: str = setting(
        "auto",
        '"auto" = console on a TTY, else JSON',
        flag="--log-format",
        choices=LOG_FORMATS,
    )
    dir: str = setting(
        "", "the launcher's log folder; empty = $ZMQLLM_HOME/logs", flag="--log-dir", metavar="DIR"
    )


@dataclass
class Config:
    model: ModelSettings = field(default_factory=ModelSettings)
    broker: BrokerSettings = field(default_factory=BrokerSettings)
    worker: WorkerSettings = field(default_factory=WorkerSettings)
    gateway: GatewaySettings = field(default_factory=GatewaySettings)
    log: LogSettings = field(default_factory=LogSettings)
    security: SecuritySettings = field(default_factory=SecuritySettings)
    ray: RaySettings = field(default_factory=RaySettings)
    stages: list[StageSpec] = field(default_factory=list)
    remotes: list[RemoteSpec] = field(default_factory=list)
