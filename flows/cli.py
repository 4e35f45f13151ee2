"""Run a flow from the command line with no server: ``python -m ringflow.flows.<name> --help``.

The options are generated from the flow function's own signature and docstring, so the
command line, the Prefect UI and ``prefect deployment run --param`` accept and check the same
parameters. The command line checks them before anything starts, in two steps:

1. each value against its type and bounds, options that contradict each other, and the data
   file's presence, format and header (:mod:`ringflow.flows.preflight`): before Prefect, Ray
   or torch is imported, so the answer comes in well under a second;
2. the flow module's ``preflight(parameters)``, if it defines one: what needs the engine
   (training options together, the model's import path and keywords), before Prefect and
   Ray are imported.

A refusal is one line on stderr and exit status 2; ``--debug`` (or ``RINGFLOW_DEBUG=1``)
adds its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from ringflow.flows.preflight import (
    PreflightError,
    check_data_file,
    check_parameters,
    field_docs,
    nested_parameters,
    parameter_docs,
    parameter_model,
)

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


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line instead of argparse's usage block: :func:`main` prints it."""
        raise PreflightError(f"{message}; see {self.prog} --help")


def build_parser(fn: Callable[..., Any]) -> argparse.ArgumentParser:
    """An ``argparse`` parser with one ``--option`` per parameter of the flow function, and
    one per field of a configuration it takes whole (``--workers`` sets ``training``'s)."""
    fn = getattr(fn, "fn", fn)  # a Prefect Flow, or the function it wraps
    docs = parameter_docs(fn)
    parser = _Parser(
        prog=f"python -m {_module_name(fn)}",
        description=(fn.__doc__ or "").split("\n\n")[0],
        epilog="The flow's result is printed as one JSON object on the last line. A refused "
        "option is one line on stderr; --debug or RINGFLOW_DEBUG=1 adds the traceback.",
    )
    schema = parameter_model(fn).model_json_schema()
    nested = nested_parameters(fn)
    for name, prop in schema["properties"].items():
        if name not in nested:
            _add_option(parser, name, name, prop, docs.get(name, ""), prop.get("default"))
            continue
        fields = _resolved(schema, prop)["properties"]
        described = field_docs(nested[name])
        for field, field_prop in fields.items():
            default = (prop.get("default") or {}).get(field, field_prop.get("default"))
            doc = f"{described.get(field, '')} ({name}.{field})"
            dest = f"{name}.{field}"
            _add_option(parser, field, dest, field_prop, doc, default, only_given=True)
    parser.add_argument(
        "--keep-serving",
        action="store_true",
        help="after the run, keep the served model up until Ctrl-C "
        "(needed when no RAY_ADDRESS points at a Ray head that outlives this process)",
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        help="show the traceback of an error (also RINGFLOW_DEBUG=1)",
    )
    return parser


def _add_option(
    parser: argparse.ArgumentParser,
    name: str,
    dest: str,
    prop: dict[str, Any],
    doc: str,
    default: Any,
    *,
    only_given: bool = False,
) -> None:
    """``--name`` for one parameter (or field: ``only_given`` leaves it out when not
    given, so its configuration's other fields keep their defaults)."""
    option = "--" + name.replace("_", "-")
    kind = _json_type(prop)
    help_text = f"{doc} (default: {default})"
    unset = argparse.SUPPRESS if only_given else default
    if kind == "boolean":
        parser.add_argument(
            option, dest=dest, action=argparse.BooleanOptionalAction, default=unset, help=help_text
        )
        return
    choices = prop.get("enum") or next(
        (p["enum"] for p in prop.get("anyOf", []) if "enum" in p), None
    )
    parser.add_argument(
        option,
        dest=dest,
        type=_TYPES[kind],
        default=unset,
        choices=choices,
        # argparse shows the choices themselves where no metavar hides them.
        metavar=None if choices else {"object": "JSON", "array": "A,B"}.get(kind, kind.upper()),
        help=help_text,
    )


def _resolved(schema: dict[str, Any], prop: dict[str, Any]) -> dict[str, Any]:
    """The schema ``prop`` refers to (``{"$ref": "#/$defs/TrainConfig"}``)."""
    ref = prop.get("$ref") or next(p["$ref"] for p in prop.get("allOf", []) if "$ref" in p)
    return schema["$defs"][ref.rsplit("/", 1)[-1]]


def _module_name(fn: Callable[..., Any]) -> str:
    """The importable name of ``fn``'s module, also when it runs as ``__main__``."""
    module = sys.modules.get(fn.__module__)
    spec = getattr(module, "__spec__", None)
    return spec.name if spec else fn.__module__


def _json_type(prop: dict[str, Any]) -> str:
    if "type" in prop:
        return prop["type"]
    if "$ref" in prop or "allOf" in prop:  # a nested configuration: SymmConfig
        return "object"
    types = [p["type"] for p in prop.get("anyOf", []) if p.get("type") != "null"]
    return types[0] if types else "string"


def main(flow: Callable[..., Any], argv: list[str] | None = None) -> int:
    """Check the arguments, run the flow, print its result as JSON on the last line.

    Args:
        flow: the flow, or its undecorated function: then the command line is checked
            before Prefect is imported, and the flow is imported from the function's module.
        argv: the arguments; ``sys.argv[1:]`` by default.

    Returns:
        The exit status: 0 for a completed run, 1 for a failed one, 2 for refused arguments.
    """
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv or os.environ.get("RINGFLOW_DEBUG", "0") not in ("", "0")
    if debug:
        os.environ["RINGFLOW_DEBUG"] = "1"  # the run's own tracebacks too (flows/logs.py)
    try:
        params, keep_serving = _check_command_line(flow, argv)
        # As before: the temporary Prefect server sends nothing out, gloo stays on loopback.
        os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        fn = getattr(flow, "fn", flow)
        preflight = getattr(sys.modules.get(fn.__module__), "preflight", None)
        if preflight is not None:
            preflight(params)
    except (ValueError, TypeError) as err:  # PreflightError, ModelError, bad combinations
        if debug:
            raise
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr, flush=True)
        return 2
    _use_local_stack()
    server = _temporary_server()  # starts while the flow's libraries are imported
    flow = _load(flow)
    if server is not None:
        server.join()
    return _run(flow, params, keep_serving=keep_serving)


def _use_local_stack() -> None:
    """Run on the local stack ``deployments/start.sh`` started, when it runs and the
    environment names no Prefect server or Ray cluster of its own: its Prefect server, its
    Ray head and the head's warm workers serve the run, with nothing started for it.
    ``RINGFLOW_LOCAL_STACK=0`` starts a temporary server and a private Ray instead."""
    if os.environ.get("RINGFLOW_LOCAL_STACK", "1") == "0":
        return
    if os.environ.get("PREFECT_API_URL") or os.environ.get("RAY_ADDRESS"):
        return
    state = os.environ.get("RINGFLOW_STATE", ".ringflow")
    if not all(_alive(os.path.join(state, "run", f"{n}.pid")) for n in _STACK):
        return
    api = f"http://127.0.0.1:{os.environ.get('RINGFLOW_PREFECT_PORT', '4200')}/api"
    os.environ.update(
        PREFECT_API_URL=api,
        RAY_ADDRESS=f"127.0.0.1:{os.environ.get('RINGFLOW_RAY_PORT', '6379')}",
        RAY_AUTH_MODE=os.environ.get("RAY_AUTH_MODE", "token"),
        RAY_AUTH_TOKEN_PATH=os.path.abspath(os.path.join(state, "ray", "auth_token")),
    )
    print(f"running on the local stack ({api}; {os.environ['RAY_ADDRESS']})", file=sys.stderr)


_STACK = ("prefect-server", "ray-head")
"""What ``deployments/start.sh`` starts for a run to use, by the names of its pid files."""


def _alive(pid_file: str) -> bool:
    try:
        with open(pid_file) as f:
            os.kill(int(f.read().strip()), 0)
    except (OSError, ValueError):
        return False
    return True


def _temporary_server() -> Any:
    """With no Prefect server named, start the temporary one the run needs in a thread now,
    so that it comes up while this process imports the flow's libraries; the thread."""
    if os.environ.get("PREFECT_API_URL"):
        return None
    import threading

    def start() -> None:
        from prefect.server.api.server import SubprocessASGIServer

        try:
            SubprocessASGIServer().start(timeout=180)
        except Exception:  # the run starts it again, and says why if it cannot
            return

    thread = threading.Thread(target=start, name="prefect-temporary-server", daemon=True)
    thread.start()
    return thread


def _check_command_line(flow: Callable[..., Any], argv: list[str]) -> tuple[dict, bool]:
    """The parameters, checked without importing anything heavy; and ``--keep-serving``."""
    fn = getattr(flow, "fn", flow)
    args = vars(build_parser(fn).parse_args(argv))
    keep_serving = args.pop("keep_serving")
    args.pop("debug")
    for key in [key for key in args if "." in key]:  # --workers 4: training={"workers": 4}
        outer, field = key.split(".", 1)
        args.setdefault(outer, {})[field] = args.pop(key)
    params = check_parameters(fn, args)
    if keep_serving and not params.get("serve", True):
        raise PreflightError(
            "--keep-serving keeps the served model up after the run, but --no-serve serves "
            "none; drop one of the two"
        )
    if params.get("data_url"):
        check_data_file(
            params["data_url"], label=params.get("label"), features=params.get("features")
        )
    return params, keep_serving


def _load(flow: Callable[..., Any]) -> Any:
    """The Prefect flow: imported here, with Prefect, the tasks and Ray, when given its
    function."""
    fn = getattr(flow, "fn", flow)
    if flow is not fn:
        return flow
    return getattr(importlib.import_module(_module_name(fn)), fn.__name__)


def _run(flow: Any, params: dict[str, Any], *, keep_serving: bool) -> int:
    from prefect.settings import (
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS,
        temporary_settings,
    )

    # The temporary server runs its database migrations first: on a busy 2-core machine that
    # takes longer than Prefect's default 20 s wait.
    with temporary_settings({PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS: 180}):
        state = flow(**params, return_state=True)
    if not state.is_completed():
        print(f"error: the run ended {state.name}: {state.message}", file=sys.stderr, flush=True)
        return 1
    result = state.result()
    if isinstance(result, dict) and "promoted" in result:  # train-pipeline's result
        from ringflow.flows.result import describe

        print("\n".join(describe(result)), file=sys.stderr, flush=True)
    print(json.dumps(result, default=str), flush=True)
    if keep_serving and params.get("serve"):
        _wait_for_interrupt(result.get("endpoint"))
    return 0


def _wait_for_interrupt(endpoint: str | None) -> None:
    """Block until Ctrl-C or SIGTERM, then take the served model and the private Ray down."""
    import signal
    import threading

    import ray

    from ringflow.serving import shutdown_serving

    # Our own handlers: the libraries loaded by then have replaced Python's SIGINT handler.
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"serving at {endpoint}; press Ctrl-C to stop", file=sys.stderr, flush=True)
    stop.wait()
    shutdown_serving()
    ray.shutdown()
