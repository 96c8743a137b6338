"""Ray Serve: the OpenAI-compatible app (``routes.build_app``) as a Ray Serve deployment whose replicas each run one
engine (with its own engine core process), scaled by Serve's autoscaler on the requests each replica has ongoing.

Contract:
- ``build_app(args)`` is the application builder for ``serve run pagellm.server.ray_serve:build_app key=value ...``
  and for Serve config files (``deploy/ray-serve.yaml``): the keys are ``pagellm ray-serve``'s flags (``model``,
  ``dtype``, ``max_replicas``, ...; dashes or underscores), checked by the same parser, so a bad value fails before
  any replica starts.
- A replica reserves ``replica_cpus`` CPUs (default 1; ``pagellm ray-serve``: the cluster's CPUs over
  ``num_replicas``, else ``max_replicas``) and its engine runs that many threads unless ``PAGELLM_NUM_THREADS`` says
  otherwise; the caller's ``PAGELLM_*`` environment reaches every replica. It takes up to ``max_ongoing_requests``
  requests at once (an engine batches them; Serve's default of 5 would queue the rest in front of it).
- Scaling: between ``min_replicas`` and ``max_replicas`` toward ``target_ongoing_requests`` per replica, after
  ``upscale_delay_s`` / ``downscale_delay_s``; ``num_replicas`` fixes the count instead.
- Health: Serve asks each replica every few seconds; one whose engine core died fails the check and is replaced.
  A replica that is stopped (scaled down, redeployed, Serve shut down) stops its engine core.
- ``run_ray_serve`` (``pagellm ray-serve``): joins the cluster ``RAY_ADDRESS`` names (else a running local one, else
  starts a local instance), starts Serve's HTTP proxy on ``--host``/``--port``, deploys, logs one line when ready,
  and on SIGINT/SIGTERM shuts Serve down (and the local instance it started).
- Serve's proxy owns the socket: ``--grpc-port`` and the TLS flags are refused by name (terminate TLS in front).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import threading
from dataclasses import dataclass
from typing import Any, Optional

from pagellm.config import EngineConfig
from pagellm.engine_args import add_engine_args, engine_kwargs
from pagellm.server.options import ServeOptions, add_serve_args, serve_options

logger = logging.getLogger(__name__)

APP_NAME = "pagellm"
_SHUTDOWN_TIMEOUT_S = 15
_HEALTH_CHECK_PERIOD_S = 2  # a replica whose engine core died is replaced within seconds (the check is a flag read)


@dataclass(frozen=True)
class ScalingOptions:
    num_replicas: Optional[int] = None  # set: a fixed count, no autoscaling
    min_replicas: int = 1
    max_replicas: int = 1
    target_ongoing_requests: float = 32.0
    max_ongoing_requests: int = 256
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    replica_cpus: Optional[float] = None

    def __post_init__(self) -> None:
        if self.num_replicas is not None and self.num_replicas < 1:
            raise ValueError(f"--num-replicas must be at least 1, got {self.num_replicas}")
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ValueError(f"need 0 <= --min-replicas ({self.min_replicas}) <= --max-replicas "
                             f"({self.max_replicas}) and --max-replicas >= 1")
        if self.target_ongoing_requests <= 0 or self.max_ongoing_requests < 1:
            raise ValueError("--target-ongoing-requests and --max-ongoing-requests must be positive")
        if self.replica_cpus is not None and self.replica_cpus <= 0:
            raise ValueError(f"--replica-cpus must be positive, got {self.replica_cpus}")

    @property
    def most_replicas(self) -> int:
        return self.num_replicas or self.max_replicas

    def deployment_options(self, cpus: float) -> dict[str, Any]:
        env = {name: value for name, value in os.environ.items() if name.startswith("PAGELLM_")}
        env.setdefault("PAGELLM_NUM_THREADS", str(max(1, int(cpus))))
        options: dict[str, Any] = {"max_ongoing_requests": self.max_ongoing_requests,
                                   "ray_actor_options": {"num_cpus": cpus, "runtime_env": {"env_vars": env}}}
        if self.num_replicas is not None:
            options["num_replicas"] = self.num_replicas
        else:
            options["autoscaling_config"] = {
                "min_replicas": self.min_replicas, "initial_replicas": max(1, self.min_replicas),
                "max_replicas": self.max_replicas, "target_ongoing_requests": self.target_ongoing_requests,
                "upscale_delay_s": self.upscale_delay_s, "downscale_delay_s": self.downscale_delay_s}
        return options


def add_ray_serve_args(cmd: argparse.ArgumentParser) -> None:
    group = cmd.add_argument_group("Ray Serve (replicas and autoscaling)")
    defaults = ScalingOptions()
    group.add_argument("--num-replicas", type=int, default=None,
                       help="a fixed number of replicas (default: autoscale between --min- and --max-replicas)")
    for name, kind, text in (
            ("min_replicas", int, "the fewest replicas (0: none while idle)"),
            ("max_replicas", int, "the most replicas"),
            ("target_ongoing_requests", float, "requests in flight per replica that the autoscaler aims at"),
            ("max_ongoing_requests", int, "requests one replica takes at once (more wait in Serve's proxy)"),
            ("upscale_delay_s", float, "seconds the load must stay high before a replica is added"),
            ("downscale_delay_s", float, "seconds the load must stay low before a replica is removed")):
        group.add_argument("--" + name.replace("_", "-"), type=kind, default=getattr(defaults, name),
                           help=f"{text} (default: {getattr(defaults, name)})")
    group.add_argument("--replica-cpus", type=float, default=None,
                       help="CPUs each replica reserves and its engine's threads (default: 1 under `serve run`; "
                            "the cluster's CPUs over --num-replicas, else --max-replicas, under `pagellm ray-serve`)")


def scaling_options(args: argparse.Namespace) -> ScalingOptions:
    return ScalingOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ScalingOptions)})


def add_args(cmd: argparse.ArgumentParser) -> None:
    """Every flag of ``pagellm ray-serve``: the model, ``pagellm serve``'s, the engine's and the scaling ones."""
    cmd.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                     help="HF directory or .gguf file (default: built-in SmolLM2)")
    cmd.add_argument("--model", default=None, help="same as the positional MODEL")
    add_serve_args(cmd)
    add_engine_args(cmd)
    add_ray_serve_args(cmd)


def parse(args: argparse.Namespace) -> tuple[EngineConfig, ServeOptions, ScalingOptions]:
    """The parsed flags as the three option sets; what Serve cannot do is refused (``ValueError``)."""
    if args.model and args.model_path and args.model != args.model_path:
        raise ValueError("give the model once (positional MODEL or --model)")
    config = EngineConfig.from_kwargs(model=args.model or args.model_path, **engine_kwargs(args))
    options = serve_options(args)
    if options.grpc_port is not None:
        raise ValueError("--grpc-port is not served under Ray Serve (its proxy serves HTTP); use pagellm serve")
    if options.tls is not None:
        raise ValueError("--ssl-keyfile/--ssl-certfile are not served under Ray Serve (its proxy owns the socket); "
                         "terminate TLS in front of it")
    if options.root_path or options.uvicorn_log_level != "warning":
        raise ValueError("--root-path and --uvicorn-log-level are the HTTP server's, which Ray Serve's proxy replaces "
                         "(see Serve's http_options)")
    return config, options, scaling_options(args)


class PagellmReplica:
    """One replica: an engine and the OpenAI-compatible app over it (Serve routes HTTP requests to the app)."""

    def __init__(self, config: EngineConfig, options: ServeOptions) -> None:
        from pagellm.engine.async_engine import AsyncLLM
        from pagellm.server.launch import build_frontend, served_names

        self.engine = AsyncLLM.from_config(config)
        try:
            self.asgi, _ = build_frontend(self.engine, config, served_names(config, options), options)
        except BaseException:
            self.engine.shutdown()
            raise

    def __serve_build_asgi_app__(self) -> Any:
        return self.asgi  # (not self.app: Serve's wrapper class owns that name)

    async def check_health(self) -> None:
        await self.engine.check_health()  # EngineDeadError once the engine core died: Serve replaces the replica

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


def deployment(config: EngineConfig, options: ServeOptions, scaling: ScalingOptions,
               cluster_cpus: Optional[float] = None) -> Any:
    """The bound Serve application: the replica class as an ingress deployment with the scaling options."""
    from ray import serve

    cpus = scaling.replica_cpus or max(1.0, (cluster_cpus or 1.0) // scaling.most_replicas)
    ingress = serve.deployment(serve.ingress()(PagellmReplica), name="PagellmReplica",
                               health_check_period_s=_HEALTH_CHECK_PERIOD_S,
                               logging_config={"enable_access_log": options.access_log})
    return ingress.options(**scaling.deployment_options(cpus)).bind(config, options)


def build_app(args: dict[str, Any]) -> Any:
    """The builder ``serve run`` and Serve config files call with their ``key=value`` arguments."""
    parser = argparse.ArgumentParser(prog="pagellm.server.ray_serve:build_app", exit_on_error=False)
    add_args(parser)
    argv: list[str] = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is True or value == "true":
            argv.append(flag)
        elif value is False or value == "false":
            argv.append("--no-" + flag[2:])
        else:
            argv.append(f"{flag}={value}")  # one token: a value is never taken for the positional MODEL
    try:
        parsed, unknown = parser.parse_known_args(argv)
    except argparse.ArgumentError as exc:
        raise ValueError(f"ray-serve argument {exc}") from None
    if unknown:
        names = ", ".join(arg.lstrip("-").split("=")[0] for arg in unknown)
        raise ValueError(f"unknown ray-serve arguments: {names}; see pagellm ray-serve --help")
    return deployment(*parse(parsed))


def run_ray_serve(config: EngineConfig, options: ServeOptions, scaling: ScalingOptions) -> int:
    """``pagellm ray-serve``: deploy on the cluster, serve until SIGINT/SIGTERM, then shut Serve down."""
    import ray
    from ray import serve

    owns = not ray.is_initialized()
    if owns:
        ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, logging_level=logging.WARNING)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": options.host, "port": options.port})
        app = deployment(config, options, scaling, ray.cluster_resources().get("CPU"))
        try:
            serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        except RuntimeError as exc:  # the replicas failed to start: their errors are in the log above
            logger.error("%s", exc)
            return 1
        replicas = f"{scaling.num_replicas} replica(s)" if scaling.num_replicas else \
            f"{scaling.min_replicas} to {scaling.max_replicas} replica(s)"
        logger.info("pagellm is serving on Ray Serve at http://%s:%d/v1 (%s); Ctrl+C or SIGTERM stops it",
                    options.host, options.port, replicas)
        stop.wait()
        return 0
    finally:
        _shutdown_serve(serve)
        if owns:
            ray.shutdown()


def _shutdown_serve(serve: Any) -> None:
    """Shut Serve down, giving up after ``_SHUTDOWN_TIMEOUT_S`` (a stop signal sent to the whole process group may
    have ended a local instance's raylet, and Serve would wait for it forever); ``ray.shutdown`` then ends the rest."""
    done = threading.Thread(target=serve.shutdown, daemon=True, name="pagellm-serve-shutdown")
    done.start()
    done.join(_SHUTDOWN_TIMEOUT_S)
    if done.is_alive():
        logger.warning("Ray Serve did not shut down within %ds; stopping Ray", _SHUTDOWN_TIMEOUT_S)
