"""Run a flow from the command line with no server: ``python -m ringflow.flows.<name> --help``.

The options are generated from the flow's own parameter schema, so the command line, the
Prefect UI and ``prefect deployment run --param`` all accept and check the same parameters.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from prefect import Flow
from prefect.exceptions import ParameterTypeError
from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, temporary_settings
from prefect.utilities.callables import parameter_schema

from ringflow.engine.cluster import quiet_environment

__all__ = ["build_parser", "main"]


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not valid JSON ({err}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object {{...}}, got {text!r}")
    return value


def _list(text: str) -> list:
    """A JSON array, or names separated by commas: ``x1,x2``."""
    if text.lstrip().startswith("["):
        value = json.loads(text)
        if isinstance(value, list):
            return value
    return [part.strip() for part in text.split(",") if part.strip()]


_TYPES = {
    "integer": int,
    "number": float,
    "string": str,
    "object": _json_object,
    "array": _list,
}


def build_parser(flow: Flow) -> argparse.ArgumentParser:
    """An ``argparse`` parser with one ``--option`` per flow parameter."""
    parser = argparse.ArgumentParser(
        prog=f"python -m {_module_name(flow)}",
        description=(flow.description or "").split("\n\n")[0],
        epilog="The flow's result is printed as one JSON object on the last line.",
    )
    for name, prop in parameter_schema(flow).properties.items():
        option = "--" + name.replace("_", "-")
        kind = _json_type(prop)
        help_text = f"{prop.get('description', '')} (default: {prop.get('default')})"
        if kind == "boolean":
            parser.add_argument(
                option,
                dest=name,
                action=argparse.BooleanOptionalAction,
                default=prop.get("default"),
                help=help_text,
            )
        else:
            parser.add_argument(
                option,
                dest=name,
                type=_TYPES[kind],
                default=prop.get("default"),
                choices=prop.get("enum"),
                metavar={"object": "JSON", "array": "A,B"}.get(kind, kind.upper()),
                help=help_text,
            )
    parser.add_argument(
        "--keep-serving",
        action="store_true",
        help="after the run, keep the served model up until Ctrl-C "
        "(needed when no RAY_ADDRESS points at a Ray head that outlives this "
        "process)",
    )
    return parser


def _module_name(flow: Flow) -> str:
    module = sys.modules.get(flow.fn.__module__)
    spec = getattr(module, "__spec__", None)
    return spec.name if spec else flow.fn.__module__


def _json_type(prop: dict[str, Any]) -> str:
    if "type" in prop:
        return prop["type"]
    types = [p["type"] for p in prop.get("anyOf", []) if p.get("type") != "null"]
    return types[0] if types else "string"


def main(flow: Flow, argv: list[str] | None = None) -> int:
    """Check the arguments, run the flow, print its result as JSON on the last line."""
    args = vars(build_parser(flow).parse_args(argv))
    keep_serving = args.pop("keep_serving")
    try:
        params = flow.validate_parameters(args)
    except ParameterTypeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    quiet_environment(PREFECT_SERVER_ANALYTICS_ENABLED="false", GLOO_SOCKET_IFNAME="lo")
    # The temporary server runs its database migrations first: on a busy 2-core machine that
    # takes longer than Prefect's default 20 s wait.
    with temporary_settings({PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS: 180}):
        state = flow(**params, return_state=True)
    if not state.is_completed():
        print(f"error: the run ended {state.name}: {state.message}", file=sys.stderr, flush=True)
        return 1
    result = state.result()
    print(json.dumps(result, default=str), flush=True)
    if keep_serving and args.get("serve"):
        _wait_for_interrupt(result.get("endpoint"))
    return 0


def _wait_for_interrupt(endpoint: str | None) -> None:
    """Block until Ctrl-C or SIGTERM, then take the served model and the private Ray down."""
    import signal
    import threading

    import ray

    from ringflow.engine.serving import shutdown_serving

    # Our own handlers: the libraries loaded by then have replaced Python's SIGINT handler.
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"serving at {endpoint}; press Ctrl-C to stop", file=sys.stderr, flush=True)
    stop.wait()
    shutdown_serving()
    ray.shutdown()
