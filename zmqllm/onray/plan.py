"""What `zmqllm ray up` asks of a Ray cluster, worked out without Ray: one actor per role
process, what each asks for, the placement group's bundles, and whether any node could
hold each bundle at all (so that a request no node can meet is an error naming the
resource, not a hang).

The actors run the very command lines `zmqllm up` gives its children (the roles are the
same programs); what differs is where they bind and connect, which only the actor knows
once it is on its node: ``{node_ip}`` in an argument is that node's address and
``{broker_ip}`` the broker's. Ray-free, torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from zmqllm.config.loading import parse_size
from zmqllm.config.settings import Config, StageSpec
from zmqllm.launch.plan import DEFAULT_STAGES, layer_flags, stage_slug

__all__ = [
    "BROKER_IP",
    "DISK",
    "NODE_IP",
    "ActorSpec",
    "Unplaceable",
    "actor_name",
    "check_fits",
    "plan_actors",
    "remotes_refused",
    "with_broker",
]

DISK = "disk_bytes"  # the custom resource a node declares for its disk (Ray has none)
NODE_IP = "{node_ip}"
BROKER_IP = "{broker_ip}"
# The broker and the gateway ask for no CPU: they fit beside a stage, and on a head node
# started with --num-cpus 0 (which then runs nothing else).
FRONT_CPUS = 0.0


class Unplaceable(ValueError):
    """A bundle no node of the cluster has the resources for."""


@dataclass(frozen=True)
class ActorSpec:
    name: str  # the actor's name in the namespace: "broker", "worker-1of2-0", "gateway"
    role: str  # the zmqllm command it runs
    args: tuple[str, ...]  # after `zmqllm ROLE`; may hold NODE_IP and BROKER_IP
    # Ray's resources of one replica: {"CPU": 4, "memory": bytes, DISK: bytes}; the
    # front-end actors ask for the head (or the named resource) instead of a bundle.
    resources: Mapping[str, float] = field(default_factory=dict)
    bundle: int | None = None  # its bundle in the placement group (workers only)


def actor_name(layers: str, replica: int) -> str:
    return f"worker-{stage_slug(layers)}-{replica}"


def stage_resources(stage: StageSpec) -> dict[str, float]:
    asked: dict[str, float] = {"CPU": stage.cpus}
    if stage.memory:
        asked["memory"] = float(parse_size(stage.memory))
    if stage.disk:
        asked[DISK] = float(parse_size(stage.disk))
    return asked


def plan_actors(cfg: Config, config_path: Path | None) -> list[ActorSpec]:
    """The broker, one actor per stage replica (each with its bundle), then the gateway.

    Every actor binds on its node's address: the broker's frontend and backend, the
    workers' peer links ("auto" binds on the address towards the broker), the gateway's
    HTTP port. Workers connect to ``{broker_ip}``, which the driver fills in once the
    broker's actor has said where it runs."""
    head = ["--config", str(config_path)] if config_path else []
    last = ["--log-format", "json", "--log-level", cfg.log.level]
    model = ["--model", cfg.model.path] + (
        ["--quant", cfg.model.quant] * (cfg.model.quant != "none")
    )
    keys = ["--keys", cfg.security.keys] if cfg.security.keys else []
    security = [*keys, *(["--insecure"] if cfg.security.insecure else [])]
    fport, bport = _port(cfg.broker.frontend), _port(cfg.broker.backend)
    out = [
        ActorSpec(
            "broker",
            "broker",
            (
                *head,
                "--frontend",
                f"tcp://{NODE_IP}:{fport}",
                "--backend",
                f"tcp://{NODE_IP}:{bport}",
                *security,
                *last,
            ),
            {"CPU": FRONT_CPUS},
        )
    ]
    bundle = 0
    for stage in cfg.stages or list(DEFAULT_STAGES):
        for replica in range(stage.count):
            name = actor_name(stage.layers, replica)
            # The memory Ray gives the stage is what its KV budget is sized from, unless
            # the config sizes that itself.
            memory: tuple[str, ...] = ()
            if stage.memory and not cfg.worker.max_memory_mb and not cfg.worker.max_kv_tokens:
                memory = ("--max-memory-mb", str(parse_size(stage.memory) >> 20))
            args = (
                *head,
                *layer_flags(stage.layers),
                "--name",
                name,
                "--broker",
                f"tcp://{BROKER_IP}:{bport}",
                "--threads",
                str(max(1, int(stage.cpus))),
                *memory,
                *model,
                *security,
                *last,
            )
            out.append(ActorSpec(name, "worker", args, stage_resources(stage), bundle))
            bundle += 1
    gateway = (
        *head,
        "--host",
        NODE_IP,
        "--port",
        str(cfg.gateway.port),
        "--broker",
        f"tcp://{BROKER_IP}:{fport}",
        "--model",
        cfg.model.path,
        *security,
        *last,
    )
    out.append(ActorSpec("gateway", "gateway", gateway, {"CPU": FRONT_CPUS}))
    return out


def remotes_refused(cfg: Config) -> str | None:
    """Why `ray up` does not start this config's ``[[remotes]]``, naming each entry, or
    None when it has none.

    `zmqllm up` hands a remote worker its upstream's URL in a file of its own, because a
    URL may hold a password; on Ray it would travel in the actor's arguments through the
    cluster's control store, and its ``api_key_file`` would be read on whichever node the
    actor lands on, against "secrets never travel through Ray" (docs/ray.md). Serving
    the rest without them would leave models the config names unserved with no word
    said, so it is refused: a remote worker joins the cluster's broker from any host as
    it is."""
    if not cfg.remotes:
        return None
    # By served name and model, never the URL: it may hold a password or a key.
    named = [
        f"#{i} (served_name {r.served_name or '-'}, model {r.model or '-'}, count {r.count})"
        for i, r in enumerate(cfg.remotes, 1)
    ]
    backend = _port(cfg.broker.backend)
    return (
        f"[[remotes]] {', '.join(named)}: remote models are not served on Ray "
        "(their URLs and keys would travel through it). Take them out of this config and "
        "start each on a host with a worker key: `zmqllm worker --remote @URL_FILE "
        f"--broker tcp://BROKER_NODE:{backend}`"
    )


def _port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def with_broker(args: Sequence[str], broker_ip: str) -> list[str]:
    """``args`` with the broker's address in (NODE_IP stays: the actor fills it)."""
    return [a.replace(BROKER_IP, broker_ip) for a in args]


def _shown(resource: str, value: float) -> str:
    if resource in ("memory", DISK):
        return f"{value / 2**30:.1f} GiB"
    return f"{value:g}"


def check_fits(specs: Sequence[ActorSpec], nodes: Sequence[Mapping[str, float]]) -> None:
    """Raise Unplaceable, naming the resource, when no node's total resources (Ray's
    ``ray.nodes()[i]["Resources"]`` of the live nodes) could hold a worker's bundle; and
    when a strict spread asks for more bundles than there are nodes (said by the caller)."""
    for spec in specs:
        if spec.bundle is None:
            continue
        for resource, asked in spec.resources.items():
            best = max((n.get(resource, 0.0) for n in nodes), default=0.0)
            if best < asked:
                have = f"the largest node has {_shown(resource, best)}"
                if resource == DISK and best == 0:
                    have = f"no node declares it (ray start --resources '{{\"{DISK}\": N}}')"
                raise Unplaceable(
                    f"{spec.name} asks for {resource} {_shown(resource, asked)}; {have}"
                )
