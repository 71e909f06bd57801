"""`zmqllm ray up | status | down`: the roles as detached, named actors on a Ray cluster.

``up`` connects to a running cluster, checks that every stage's bundle fits some node
(an error naming the resource otherwise), makes one placement group of the workers'
bundles (``[ray] strategy``), starts the broker on the head (or on the node with
``[ray] front_resource``), the workers in their bundles, then the gateway, and returns
once ``/ready`` answers 200: a warm-up token went through a complete route. A config
with ``[[remotes]]`` is refused (plan.py says why). Every actor restarts without limit;
Ray keeps the actor, the actor keeps its role process with `zmqllm up`'s backoff
(role_keeper.py). ``status`` shows both, failing roles first. ``down`` stops each role,
kills its actor and removes the placement group.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from zmqllm.config.flags import apply_flags
from zmqllm.config.loading import load_config
from zmqllm.config.settings import Config
from zmqllm.launch.launcher import http_status
from zmqllm.launch.split import auto_stages
from zmqllm.launch.supervision import CRASH_WINDOW_S
from zmqllm.log import printable
from zmqllm.onray.plan import (
    ActorSpec,
    Unplaceable,
    check_fits,
    plan_actors,
    remotes_refused,
    with_broker,
)

__all__ = ["format_status", "role_shown", "run_ray", "status_rows"]

PLACEMENT_GROUP = "zmqllm-stages"
POLL_S = 1.0
# How long `ray status` waits for the actors to say how their roles are.
INFO_TIMEOUT_S = 5.0


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
    refused = remotes_refused(cfg)
    if refused:
        print(f"zmqllm ray up: {refused}", file=sys.stderr)
        return 2
    # layers = "auto": split by each stage's cpus and memory, measured here (launch/split.py).
    cfg = auto_stages(cfg, path, ray=True, say=_say)
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
            _say_troubled(ray, cfg.ray.namespace)
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


# --- `ray status` -----------------------------------------------------------------------

# What an actor's info() adds about its role; None each when it did not answer.
ROLE_FIELDS = ("role_state", "exits", "last_exit", "next_start_in", "starts")
_ORDER = {"failing": 0, "restarting": 1, "running": 2}


def status_rows(
    actors: Sequence[Mapping[str, Any]], infos: Mapping[str, Mapping[str, Any] | None]
) -> list[dict[str, Any]]:
    """The actor table's rows (no handles) with each actor's role fields merged in, from
    ``infos`` by actor name (None, or absent: it did not answer, as while Ray restarts
    it). Failing roles first, then restarting, running, unknown; by name within each."""
    out = []
    for actor in actors:
        row = {k: v for k, v in actor.items() if k != "handle"}
        info = infos.get(str(actor["name"])) or {}
        row.update({k: info.get(k) for k in ROLE_FIELDS})
        out.append(row)
    return sorted(out, key=lambda r: (_ORDER.get(str(r["role_state"]), 3), str(r["name"])))


def role_shown(row: Mapping[str, Any]) -> str:
    """One of "running", "restarting in 4 s", "FAILING, restarting in 32 s", "FAILING, running"
    (started again, not yet up a whole window), or "?" (no answer)."""
    state, due = row.get("role_state"), row.get("next_start_in")
    if state not in _ORDER:
        return "?"
    then = "running" if due is None else f"restarting in {float(due):g} s"
    return f"FAILING, {then}" if state == "failing" else then


def format_status(rows: Sequence[Mapping[str, Any]]) -> str:
    headers = [
        "actor",
        "state",
        "node",
        "pid",
        "restarts",
        "role",
        f"exits/{CRASH_WINDOW_S:.0f}s",
        "last exit",
    ]
    table = [headers]
    for r in rows:
        exits = r.get("exits")
        table.append(
            [
                printable(str(r["name"])),
                str(r["state"]),
                str(r["node_ip"]),
                str(r["pid"]),
                str(r["restarts"]),
                role_shown(r),
                "?" if exits is None else str(exits),
                str(r.get("last_exit") or "-"),
            ]
        )
    widths = [max(len(line[i]) for line in table) for i in range(len(headers))]
    numeric = {3, 4, 6}  # right-aligned
    lines = []
    for line in table:
        cells = [
            cell.rjust(widths[i]) if i in numeric else cell.ljust(widths[i])
            for i, cell in enumerate(line)
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def _say_troubled(ray: Any, namespace: str) -> None:
    """The roles that keep exiting, and where their logs are: most often why."""
    actors = _actors(ray, namespace)
    infos = _role_infos(ray, actors)
    for row in status_rows(actors, infos):
        if row["role_state"] in ("failing", "restarting"):
            log = (infos.get(row["name"]) or {}).get("log", "?")
            print(
                f"  {row['name']}: {role_shown(row)}, {row['exits']} exits within "
                f"{CRASH_WINDOW_S:g} s, the last {row['last_exit']}; its log on "
                f"{row['node_ip']}: {printable(str(log))}",
                file=sys.stderr,
            )


def _role_infos(ray: Any, rows: list[dict[str, Any]]) -> dict[str, dict[str, Any] | None]:
    """Each live actor's info() (its role's state), asked of all at once; an actor that
    does not answer within INFO_TIMEOUT_S (busy, or its node going away) is None."""
    asked = {str(r["name"]): r["handle"].info.remote() for r in rows if r["state"] == "ALIVE"}
    refs = list(asked.values())
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=INFO_TIMEOUT_S) if refs else ([], [])
    out: dict[str, dict[str, Any] | None] = {}
    for name, ref in asked.items():
        out[name] = None
        if ref in ready:
            with contextlib.suppress(Exception):  # it died meanwhile: shown as unknown
                out[name] = ray.get(ref)
    return out


def ray_status(ns: argparse.Namespace) -> int:
    cfg, _ = _config(ns)
    ray = _connect(cfg)
    actors = _actors(ray, cfg.ray.namespace)
    rows = status_rows(actors, _role_infos(ray, actors))
    if ns.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(format_status(rows))
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
