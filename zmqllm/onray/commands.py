"""`zmqllm ray up | status | down`: the roles as detached, named actors on a Ray cluster.

``up`` connects to a running cluster, checks that every stage's bundle fits some node
(an error naming the resource otherwise), makes one placement group of the workers'
bundles (``[ray] strategy``), starts the broker on the head (or on the node with
``[ray] front_resource``), the workers in their bundles, then the gateway, and returns
once ``/ready`` answers 200: a warm-up token went through a complete route. Every actor
restarts without limit; Ray keeps the actor, the actor keeps its role process (actor.py).
``down`` stops each role, kills its actor and removes the placement group.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from zmqllm.config.flags import apply_flags
from zmqllm.config.loading import load_config
from zmqllm.config.settings import Config
from zmqllm.launch.launcher import http_status
from zmqllm.onray.plan import ActorSpec, Unplaceable, check_fits, plan_actors, with_broker

__all__ = ["run_ray"]

PLACEMENT_GROUP = "zmqllm-stages"
POLL_S = 1.0


def _say(text: str) -> None:
    print(f"[zmqllm ray] {text}", flush=True)


def _config(ns: argparse.Namespace) -> tuple[Config, Path | None]:
    path = Path(ns.config).expanduser().resolve() if ns.config else None
    return apply_flags(load_config(path), "ray", ns), path


def _connect(cfg: Config) -> Any:
    import ray

    ray.init(
        address=cfg.ray.address or None,
        namespace=cfg.ray.namespace,
        log_to_driver=False,
        logging_level=logging.ERROR,
    )
    return ray


def _front_options(cfg: Config) -> dict[str, Any]:
    """The broker and gateway: on the head, or where the named resource is."""
    if cfg.ray.front_resource:
        return {"resources": {cfg.ray.front_resource: 0.001}}
    return {"resources": {"node:__internal_head__": 0.001}}


def _start(ray: Any, spec: ActorSpec, options: dict[str, Any], args: list[str]) -> Any:
    from zmqllm.onray.actor import RoleActor

    opts = {k: v for k, v in spec.resources.items() if k not in ("CPU", "memory")}
    resources = {**opts, **options.pop("resources", {})}
    return (
        ray.remote(RoleActor)
        .options(
            name=spec.name,
            lifetime="detached",
            max_restarts=-1,
            num_cpus=spec.resources.get("CPU", 0),
            memory=spec.resources.get("memory") or None,
            resources=resources or None,
            **options,
        )
        .remote(spec.name, spec.role, args)
    )


def _wait_placed(pg: Any, timeout: float) -> bool:
    import ray

    try:
        ray.get(pg.ready(), timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        return False
    return True


def ray_up(ns: argparse.Namespace) -> int:
    cfg, path = _config(ns)
    specs = plan_actors(cfg, path)
    ray = _connect(cfg)
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    workers = [s for s in specs if s.bundle is not None]
    try:
        check_fits(specs, nodes)
        if cfg.ray.strategy == "STRICT_SPREAD" and len(workers) > len(nodes):
            raise Unplaceable(
                f"STRICT_SPREAD puts each of the {len(workers)} workers on a node of its "
                f"own; the cluster has {len(nodes)} nodes"
            )
    except Unplaceable as exc:
        print(f"zmqllm ray up: {exc}", file=sys.stderr)
        return 2
    with contextlib.suppress(ValueError):
        ray.get_actor(specs[0].name, namespace=cfg.ray.namespace)
        print(
            f"zmqllm ray up: a cluster is already up in namespace {cfg.ray.namespace!r} "
            "(`zmqllm ray status`; `zmqllm ray down` first)",
            file=sys.stderr,
        )
        return 1
    begun = time.monotonic()
    bundles = [dict(s.resources) for s in workers]
    pg = placement_group(
        bundles, strategy=cfg.ray.strategy, name=PLACEMENT_GROUP, lifetime="detached"
    )
    if not _wait_placed(pg, cfg.ray.ready_timeout):
        print(
            "zmqllm ray up: the stages could not all be placed together "
            f"({cfg.ray.strategy}); see `ray status` for what is free",
            file=sys.stderr,
        )
        return 1
    broker = _start(ray, specs[0], _front_options(cfg), list(specs[0].args))
    where = ray.get(broker.info.remote())
    broker_ip = where["node_ip"]
    _say(f"broker on {broker_ip}")
    for spec in workers:
        strategy = PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=spec.bundle or 0
        )
        _start(ray, spec, {"scheduling_strategy": strategy}, with_broker(spec.args, broker_ip))
    gateway_spec = specs[-1]
    gateway = _start(
        ray, gateway_spec, _front_options(cfg), with_broker(gateway_spec.args, broker_ip)
    )
    gateway_ip = ray.get(gateway.info.remote())["node_ip"]
    url = f"http://{gateway_ip}:{cfg.gateway.port}"
    deadline = begun + cfg.ray.ready_timeout
    while http_status(f"{url}/ready") != 200:
        if time.monotonic() > deadline:
            print(
                f"zmqllm ray up: not ready after {cfg.ray.ready_timeout:g}s; "
                "`zmqllm ray status` shows each actor and its log",
                file=sys.stderr,
            )
            return 1
        time.sleep(POLL_S)
    _say(f"ready in {time.monotonic() - begun:.1f}s: {len(workers)} workers, gateway {url}")
    print(f'try:  curl -N -d "Why is the sky blue?" {url}/chat', flush=True)
    return 0


def _actors(ray: Any, namespace: str) -> list[dict[str, Any]]:
    """Every live or restarting actor of ours in ``namespace``, from the GCS's actor
    table (no dashboard needed): name, state, node address, pid, restarts."""
    from ray._private.state import actors as actor_table

    rows = []
    for actor_id, info in actor_table().items():
        name = info.get("Name")
        if info.get("ActorClassName") != "RoleActor" or not name or info["State"] == "DEAD":
            continue
        try:  # the same name may live in another namespace
            handle = ray.get_actor(name, namespace=namespace)
        except ValueError:
            continue
        if handle._actor_id.hex() != actor_id:
            continue
        rows.append(
            {
                "name": name,
                "state": info["State"],
                "node_ip": info["Address"]["IPAddress"],
                "pid": info["Pid"],
                "restarts": info["NumRestarts"],
                "handle": handle,
            }
        )
    return sorted(rows, key=lambda r: str(r["name"]))


def ray_status(ns: argparse.Namespace) -> int:
    cfg, _ = _config(ns)
    ray = _connect(cfg)
    rows = [{k: v for k, v in r.items() if k != "handle"} for r in _actors(ray, cfg.ray.namespace)]
    if ns.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'actor':24s} {'state':12s} {'node':16s} {'pid':>8} {'restarts':>8}")
    for r in rows:
        print(
            f"{r['name']:24s} {r['state']:12s} {r['node_ip']:16s} {r['pid']!s:>8} "
            f"{r['restarts']!s:>8}"
        )
    return 0


def ray_down(ns: argparse.Namespace) -> int:
    cfg, _ = _config(ns)
    ray = _connect(cfg)
    from ray.util.placement_group import get_placement_group, remove_placement_group

    rows = _actors(ray, cfg.ray.namespace)
    for row in rows:
        # An actor restarting or gone: killed below all the same.
        with contextlib.suppress(Exception):
            ray.get(row["handle"].stop.remote(), timeout=30)
        ray.kill(row["handle"], no_restart=True)
    with contextlib.suppress(ValueError):
        remove_placement_group(get_placement_group(PLACEMENT_GROUP))
    _say(f"removed {len(rows)} actors and the placement group")
    return 0


def run_ray(ns: argparse.Namespace) -> int:
    try:
        import ray  # noqa: F401
    except ImportError:
        print("zmqllm ray: Ray is not installed: pip install 'zmqllm[ray]'", file=sys.stderr)
        return 2
    commands = {"up": ray_up, "status": ray_status, "down": ray_down}
    return commands[ns.ray_command](ns)
