"""The `raypd` command. Each subcommand is one `_add_<name>(subparsers)` function that declares its arguments and sets
`run` (args -> exit code); adding one is a function and a line in SUBCOMMANDS. Heavy imports (torch, Ray, matplotlib)
happen inside `run`, so `raypd config-schema` and `raypd validate` answer at once."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import signal
import sys
import threading
import time

from pydantic import ByteSize

from cluster.config import ConfigError, RaypdConfig, Role, load_config, placement_problems


def _add_config_schema(sub) -> None:
    p = sub.add_parser("config-schema", help="print the deployment YAML's JSON schema")
    p.set_defaults(run=_config_schema)


def _config_schema(args: argparse.Namespace) -> int:
    print(json.dumps(RaypdConfig.model_json_schema(), indent=2))
    return 0


def _add_validate(sub) -> None:
    p = sub.add_parser("validate", help="check a deployment YAML without starting anything")
    p.add_argument("config", metavar="CONFIG", help="deployment YAML, e.g. configs/local.yaml")
    p.add_argument("--cluster", metavar="RAY_UP_YAML", help="also check that the node types of this `ray up` file "
                   "hold each tensor-parallel replica's bundles, e.g. configs/cluster/aws.yaml")
    p.set_defaults(run=_validate)


def _validate(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    e = config.engine
    pool = f"{e.num_blocks} blocks" if e.num_blocks else (e.kv_cache_bytes or ByteSize(512 << 20)).human_readable()
    print(f"{args.config}: ok")
    print(f"  model {config.model_name} ({config.model}), dtype {config.dtype}, {e.device}, KV pool {pool}")
    for name in ("prefill", "decode", "postproc", "ingress"):
        print(f"  {name}: {_describe_role(getattr(config, name))}")
    if config.has_vision_tower:
        m = config.multimodal
        urls = ", ".join(["data:"] + ["http(s)://"] * m.allow_remote_urls
                         + [f"file:// under {m.allowed_local_media_path}"] * bool(m.allowed_local_media_path))
        print(f"  encoder: {_describe_role(config.encoder)}; cache {m.encoder_cache_bytes.human_readable()} "
              f"each; image URLs: {urls}")
    else:
        print("  encoder: not started (the model has no vision tower)")
    print(f"  router {_describe_router(config.router)}; "
          f"http {config.http.host}:{config.http.port}"
          f"{' (API key required)' if config.http.api_key_value() else ''}")
    return _check_placement(config, args.cluster) if args.cluster else 0


def _check_placement(config: RaypdConfig, cluster_file: str) -> int:
    import yaml

    node_types = yaml.safe_load(pathlib.Path(cluster_file).read_text()).get("available_node_types", {})
    errors, warnings = placement_problems(config, node_types)
    for line in warnings:
        print(f"  warning: {line}")
    for line in errors:
        print(f"raypd: {cluster_file}: {line}", file=sys.stderr)
    return 2 if errors else 0


def _describe_router(router) -> str:
    rules = [router.policy.value]
    if router.max_local_prefill_tokens:
        rules.append(f"prompts under {router.max_local_prefill_tokens} uncached tokens prefill on their decode replica")
    if router.max_prefill_backlog_tokens:
        rules.append(f"prompts prefill on their decode replica while {router.max_prefill_backlog_tokens}+ tokens wait "
                     "at prefill")
    if router.local_prefill_when_idle:
        rules.append("a prompt arriving at an idle ingress prefills on its decode replica")
    return ", ".join(rules)


def _describe_role(role: Role) -> str:
    a = role.autoscaling
    scale = f"{a.min_replicas}..{a.max_replicas} replicas (autoscaling)" if a else f"{role.replicas or 1} replica(s)"
    if a is not None:
        on = (", ".join(f"{name} {value:g}" for name, value in a.slo.targets().items()) if a.slo
              else f"target_ongoing_requests {a.target_ongoing_requests:g}")
        scale += f" on {on} per replica (up after {a.upscale_delay_s:g} s, down after {a.downscale_delay_s:g} s)"
    tp = (f", tensor_parallel_size {role.tensor_parallel_size} ({role.placement_strategy} bundles of "
          f"{role.bundle()})" if role.tensor_parallel_size > 1 else "")
    nice = f", nice +{role.nice}" if role.nice else ""
    return f"{scale}, each num_cpus={role.num_cpus}, num_gpus={role.num_gpus}, resources={role.resources}{tp}{nice}"


def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="benchmark any OpenAI-compatible completions endpoint")
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="API root (default: %(default)s)")
    p.add_argument("--model", required=True, help="model name the endpoint serves")
    p.add_argument("--api-key", default=None, help="bearer key, if the endpoint needs one")
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--request-rate", type=float, default=math.inf, help="req/s, Poisson arrivals; inf: all at once")
    p.add_argument("--concurrency", type=int, default=None, help="most requests in flight (default: no cap)")
    p.add_argument("--input-len", type=int, default=128, help="prompt length in words (about tokens)")
    p.add_argument("--output-len", type=int, default=128, help="max_tokens per request (sent with ignore_eos)")
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in len*(1-r)..len*(1+r)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput counts requests with TTFT within this")
    p.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput counts requests with TPOT within this")
    p.add_argument("--request-timeout-s", type=float, default=120.0, help="each request's total budget")
    p.add_argument("--num-warmups", type=int, default=0, help="unrecorded requests sent first, one at a time")
    p.add_argument("--workload", choices=("random", "chat"), default="random",
                   help="random: independent prompts; chat: multi-turn conversations sharing a system prompt, "
                        "each turn sent when the previous reply ended (--request-rate: conversations per second)")
    p.add_argument("--num-turns", type=int, default=4, help="chat: turns per conversation (divides --num-requests)")
    p.add_argument("--system-len", type=int, default=256, help="chat: words of the shared system prompt")
    p.add_argument("--json", metavar="OUT", default=None, help="write results (per request too) to this JSON file")
    p.add_argument("--plot", metavar="OUT.png", default=None, help="draw latency CDFs to this PNG")
    p.set_defaults(run=_bench)


def _bench(args: argparse.Namespace) -> int:
    from benchmarks.client import run_benchmark
    from benchmarks.workload import BenchConfig
    from benchmarks.report import format_table, plot_latency_cdfs, write_json
    from benchmarks.server_stats import scrape, speculation_lines

    try:
        config = BenchConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(BenchConfig)})
    except ValueError as exc:  # the message names the setting
        raise ConfigError(str(exc)) from None
    before = scrape(args.base_url, args.api_key)
    results = {args.base_url: run_benchmark(config)}
    print(format_table(results))
    for line in speculation_lines(before, scrape(args.base_url, args.api_key)):
        print(line)
    errors = results[args.base_url].errors()
    for error in errors[:5]:
        print(f"failed: {error}", file=sys.stderr)
    if args.json:
        write_json(results, args.json)
    if args.plot:
        plot_latency_cdfs(results, args.plot)
    return 1 if errors else 0


def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="serve a deployment YAML with Ray Serve (OpenAI endpoints)")
    p.add_argument("config", metavar="CONFIG", help="deployment YAML, e.g. configs/local.yaml")
    p.add_argument("--model", default=None, help="checkpoint directory to serve instead of the YAML's `model`")
    p.add_argument("--address", default=None, help="Ray cluster to deploy to (e.g. auto); default: start Ray here")
    p.add_argument("--detach", action="store_true", help="deploy and return (needs --address); running it again "
                                                         "with edited replica counts rescales live")
    p.set_defaults(run=_serve)


def _serve(args: argparse.Namespace) -> int:
    config = load_config(args.config, model=args.model)  # a bad config fails here, before Ray starts
    if args.detach and not args.address:
        raise ConfigError("--detach needs --address: a Ray started here ends when this command does")
    if args.address is None:
        from cluster.serving.ray_env import use_serve_env

        use_serve_env()
    import ray
    from ray import serve

    from cluster.serving.app import deploy
    from cluster.serving.directory import Directory
    from cluster.serving.ray_env import SERVE_LOGGING
    from cluster.edge.watch import DRAINING_KEY

    # Replica warnings reach this console; Serve's own chatter (access logs, info) does not (SERVE_LOGGING).
    ray.init(address=args.address or "local", include_dashboard=False if args.address is None else None,
             namespace="raypd", log_to_driver=True, logging_level="WARNING")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # replaces Ray's handler, which would abort without draining;
        signal.signal(sig, lambda *_: stop.set())  # set before deploying: a signal while it deploys drains too
    serve.start(http_options={"host": config.http.host, "port": config.http.port}, logging_config=SERVE_LOGGING)
    directory = Directory(_APP)
    directory.set_flag(DRAINING_KEY + _APP.encode(), False)  # a drain an earlier run left behind
    deploy(config, _APP, "/", logging_config=SERVE_LOGGING)
    print(f"raypd: serving {config.model_name!r} at http://{config.http.host}:{config.http.port}/v1", flush=True)
    if args.detach:
        return 0
    stop.wait()
    _drain(directory, config.shutdown_grace_s)
    serve.shutdown()
    ray.shutdown()
    print("raypd: stopped", flush=True)
    return 0


_APP = "raypd"


def _drain(directory, grace_s: float) -> None:
    """Stops accepting (every ingress replica answers 503 within a second) and waits, at most grace_s, until no
    request is in flight."""
    from cluster.edge.watch import DRAINING_KEY

    print(f"raypd: stopping: new requests get 503; waiting up to {grace_s:.0f} s for those in flight", flush=True)
    directory.set_flag(DRAINING_KEY + _APP.encode())
    deadline = time.monotonic() + grace_s
    time.sleep(min(grace_s, 1.5))  # every ingress replica has seen the flag and published its count since
    left = None
    while time.monotonic() < deadline:
        left = sum(int(e.stats.get("in_flight", 0)) for e in directory.entries("ingress"))
        if left == 0:
            break
        time.sleep(0.2)
    if left:
        print(f"raypd: {left} request(s) still in flight after {grace_s:.0f} s: they are cut off", flush=True)
    directory.set_flag(DRAINING_KEY + _APP.encode(), False)


def _add_plan(sub) -> None:
    p = sub.add_parser("plan", help="recommend prefill and decode replica counts for a workload and SLOs, from a "
                                    "profile of this hardware and a simulation of the deployment")
    p.add_argument("config", metavar="CONFIG", help="deployment YAML whose model and engine settings are planned for")
    p.add_argument("--request-rate", type=float, default=4.0, help="req/s, Poisson arrivals (default: %(default)s)")
    p.add_argument("--input-len", type=int, default=128, help="prompt length in words, as raypd bench")
    p.add_argument("--output-len", type=int, default=128, help="output tokens per request")
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in len*(1-r)..len*(1+r)")
    p.add_argument("--num-requests", type=int, default=200, help="requests simulated (and sent by --validate)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-ms", type=float, required=True, help="time to first token each request must meet")
    p.add_argument("--slo-tpot-ms", type=float, required=True, help="time per output token each request must meet")
    p.add_argument("--attainment", type=float, default=0.9, help="share of requests within both SLOs required")
    p.add_argument("--max-replicas", type=int, default=6, help="most prefill + decode replicas considered")
    p.add_argument("--profile", metavar="FILE", default=None, help="reuse a saved profile instead of profiling")
    p.add_argument("--save-profile", metavar="FILE", default=None, help="write the profile (and calibration) here")
    p.add_argument("--calibrate", type=float, nargs="+", metavar="RATE", default=None,
                   help="measure the serving path's overheads on a local Serve deployment of CONFIG, with the "
                        "workload at these rates (req/s, two or more; more follow a non-linear slow-down better)")
    p.add_argument("--validate", type=float, nargs="+", metavar="RATE", default=None,
                   help="also measure CONFIG's deployment (1 prefill + 1 decode, and colocated) with raypd bench at "
                        "these rates and print predicted against measured p50s")
    p.add_argument("--out", metavar="YAML", default="plan.yaml", help="where to write the recommended deployment")
    p.set_defaults(run=_plan)


def _plan(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    if not 0 < args.attainment <= 1 or args.max_replicas < 1:
        raise ConfigError("plan --attainment must be in (0, 1] and --max-replicas >= 1")
    if args.calibrate is not None and (len(args.calibrate) < 2 or min(args.calibrate) <= 0):
        raise ConfigError(f"plan --calibrate needs two or more request rates > 0, got {args.calibrate}")
    from benchmarks import plan_check
    from cluster.planning import plan

    workload = plan.Workload(args.input_len, args.output_len, args.range_ratio, args.request_rate,
                             args.num_requests, args.seed)
    workload.bench_config(config.model_name)  # a bad length or rate fails here, naming the setting
    profile = plan.Profile.load(args.profile) if args.profile else plan.profile(config)
    if args.calibrate or args.validate:
        with plan_check.serving(config) as measure:
            if args.calibrate:
                profile = plan_check.calibrate(profile, config, workload, tuple(args.calibrate), measure)
            checks = plan_check.validate(profile, config, workload, args.validate, measure) if args.validate else []
        if checks:
            print("simulator against raypd bench on this machine:\n" + plan_check.format_checks(checks) + "\n")
    if args.save_profile:
        profile.save(args.save_profile)
    print(plan.describe_profile(profile) + "\n")
    outcomes, best = plan.search(profile, plan.requests_of(workload, config), args.slo_ttft_ms, args.slo_tpot_ms,
                                 args.max_replicas, args.attainment)
    print(f"{args.num_requests} requests at {args.request_rate:g} req/s, {args.input_len} words in, "
          f"{args.output_len} tokens out; SLOs TTFT <= {args.slo_ttft_ms:g} ms, TPOT <= {args.slo_tpot_ms:g} ms "
          f"for {args.attainment:.0%} of requests:\n" + plan.format_outcomes(outcomes, best))
    if best is None:
        print(f"raypd: no deployment of up to {args.max_replicas} replicas meets the SLOs", file=sys.stderr)
        return 1
    pathlib.Path(args.out).write_text(plan.plan_yaml(args.config, best))
    print(f"\nrecommended: {best.num_prefill} prefill + {best.num_decode} decode replica(s)"
          f"{' (colocated)' if best.num_prefill == 0 else ''}; wrote {args.out}")
    return 0


SUBCOMMANDS = (_add_config_schema, _add_validate, _add_serve, _add_bench, _add_plan)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raypd", description="Disaggregated prefill/decode LLM serving on Ray.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except ConfigError as exc:  # a bad config or bench setting: the message names the field; no traceback
        print(f"raypd: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
