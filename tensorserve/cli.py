"""``tensorserve`` command line: ``serve``, ``top``, and ``bench`` when installed.

``bench`` lives in its own distribution, tensorserve-bench (bench/ in the
repository): tooling, not product. Any distribution adds commands through
the ``tensorserve.commands`` entry-point group; a known command whose
distribution is missing says how to install it and exits 2.

``serve``'s flags are generated from ``Settings``: one per field, with its
type, choices, description, default and environment variable, so a setting
is declared once. Asking for help imports neither torch nor aiohttp: the
server (``tensorserve.http.server``) and the load generator are imported only
when they run.
"""

from __future__ import annotations

import argparse
import sys
import types
import typing
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any, NoReturn

from pydantic import ValidationError

from tensorserve import __version__
from tensorserve.settings import MODEL_OVERRIDES, Settings
from tensorserve.tracing import missing_sdk

ENV_PREFIX = str(Settings.model_config.get("env_prefix", ""))
# Each entry point of this group is ``add_parser(subparsers)`` for one command.
COMMANDS_GROUP = "tensorserve.commands"
# Commands that other distributions bring, named so that asking for one that
# is not installed says what to install: {command: (distribution, the pip
# arguments that install it from the repository's root)}. tensorserve-bench is
# on no package index: it is the repository's bench/ folder.
OPTIONAL_COMMANDS = {"bench": ("tensorserve-bench", "-e bench")}
GRPC_MISSING = (
    "the gRPC front end needs grpcio and protobuf ({}): pip install grpcio 'protobuf<7', "
    "or serve HTTP only with --grpc-port -1 (TENSORSERVE_GRPC_PORT=-1)"
)
# What `tensorserve --help` says first: for users (the module docstring is for
# maintainers).
DESCRIPTION = (
    "Serve a Triton-style model repository with dynamic batching (serve), watch a "
    "running server (top), and measure one under load (bench, when installed)."
)


def flag_name(field: str) -> str:
    """``max_batch_tokens`` -> ``--max-batch-tokens``."""
    return "--" + field.replace("_", "-")


def env_name(field: str) -> str:
    """``max_batch_tokens`` -> ``TENSORSERVE_MAX_BATCH_TOKENS``."""
    return ENV_PREFIX + field.upper()


def _flag_type(annotation: Any) -> tuple[Any, list[Any] | None]:
    """(argparse type, choices) of a settings field's annotation."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        if len(args) == 1:
            return _flag_type(args[0])  # X | None: every flag is optional anyway
        return str, None  # a number or a word ("auto"): Settings parses and checks it
    if typing.get_origin(annotation) is typing.Literal:
        return type(args[0]), args
    if annotation is Path:
        return Path, None
    if annotation in (int, float, str, bool):
        return annotation, None
    raise TypeError(f"no command-line flag for a setting of type {annotation!r}")


def _help(name: str) -> str:
    field = Settings.model_fields[name]
    if name in MODEL_OVERRIDES:
        default = "the model's own"
    elif field.default is None:
        default = "unset"
    elif isinstance(field.default, bool):
        default = "on" if field.default else "off"
    else:
        default = str(field.default)
    # argparse %-formats help strings.
    text = f"{field.description} (default: {default}; env {env_name(name)})"
    return text.replace("%", "%%")


def add_serve_parser(sub: Any) -> argparse.ArgumentParser:
    """``serve`` with one flag per ``Settings`` field. Every flag defaults to
    None, meaning "not given": the environment and then the field's default
    decide (``settings_from_args``)."""
    parser = sub.add_parser(
        "serve",
        help="serve a model repository over HTTP and gRPC",
        description="Serve a model repository over HTTP and KServe v2 gRPC. Flags override environment "
        f"variables ({ENV_PREFIX}*), which override the defaults.",
    )
    overrides = parser.add_argument_group("overrides applied to every model's config.toml")
    for name, field in Settings.model_fields.items():
        group = overrides if name in MODEL_OVERRIDES else parser
        kind, choices = _flag_type(field.annotation)
        if kind is bool:
            # --access-log / --no-access-log: either can beat the environment.
            group.add_argument(
                flag_name(name),
                action=argparse.BooleanOptionalAction,
                default=None,
                help=_help(name),
            )
        else:
            group.add_argument(
                flag_name(name), type=kind, choices=choices, default=None, help=_help(name)
            )
    return parser


def settings_from_args(args: argparse.Namespace) -> Settings:
    """CLI flags override environment variables, which override defaults."""
    given = {
        name: value
        for name, value in vars(args).items()
        if name in Settings.model_fields and value is not None
    }
    return Settings(**given)


def _settings_error(error: ValidationError) -> str:
    """One line per bad setting, named as the flag and the variable."""
    lines = []
    for problem in error.errors():
        name = str(problem["loc"][0]) if problem["loc"] else "?"
        where = f"{flag_name(name)} / {env_name(name)}" if name in Settings.model_fields else name
        lines.append(f"{where}: {problem['msg']}")
    return "; ".join(lines)


class OneLineErrors(argparse.ArgumentParser):
    """A usage error is one line on stderr (``tensorserve serve: error: ...``)
    and exit status 2: a log collector or a container's status keeps it whole."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def serve(settings: Settings) -> int:
    """Serve until stopped (0); a server that cannot start says why in one
    line and returns 1, having started nothing (2: tracing asked for without
    the SDK installed, a usage error like a bad flag)."""
    if settings.otlp_endpoint is not None and (missing := missing_sdk()) is not None:
        print(f"tensorserve serve: error: {missing}", file=sys.stderr)
        return 2
    _prestart_template(settings)
    try:
        return _serve(settings)
    finally:
        from tensorserve.runtime import shared_workers

        shared_workers.end_prestart()  # nothing loaded: it goes (a no-op once models took it)


def _prestart_template(settings: Settings) -> None:
    """Where the models' workers will likely be forked from a worker template
    in this process (``isolation = "auto"`` on 2 CPUs or more, with no GPU to
    feed: there ``auto`` is a thread), spawn it now: it imports torch while
    this process does, which halves the time to ready on a small machine
    (docs/threading.md, "One template, one spare")."""
    from tensorserve.gpus import torch_has_cuda, visible_gpus
    from tensorserve.host import available_cpus

    feeds_gpu = settings.device != "cpu" and visible_gpus() > 0 and torch_has_cuda()
    in_workers = settings.isolation == "process" or (
        settings.isolation != "thread" and not feeds_gpu
    )
    if (
        in_workers
        and settings.frontends_choice().count == 1
        and settings.model_control_mode != "explicit"
        and available_cpus() >= 2
    ):
        from tensorserve.runtime import shared_workers

        shared_workers.prestart(settings.log_level)


def _serve(settings: Settings) -> int:
    from tensorserve.http.server import StartupError, run  # aiohttp and torch: only to serve

    front_ends = []
    if settings.grpc_port >= 0:  # -1: HTTP only
        try:
            from tensorserve.grpc.server import GrpcFrontEnd  # grpcio: only when serving gRPC
        except ImportError as exc:
            print(f"tensorserve serve: error: {GRPC_MISSING.format(exc)}", file=sys.stderr)
            return 1
        front_ends.append(GrpcFrontEnd)
    try:
        # Unset, the front ends depend on the GPUs: decided here, before any
        # model is placed (NVML, no CUDA context in this process).
        if settings.frontends_choice().count > 1:  # a scheduler process and its front ends
            from tensorserve.frontends.supervisor import run as run_with_frontends

            run_with_frontends(settings)
            return 0
        run(settings, front_ends)
    except StartupError as exc:
        print(f"tensorserve serve: error: {exc}", file=sys.stderr)
        return 1
    return 0


def add_installed_commands(sub: Any) -> dict[str, str]:
    """Add the parser of every command in ``COMMANDS_GROUP``; return, for
    each optional command that could not be added, why and what to install."""
    missing = {
        command: f"tensorserve {command} needs the {distribution} package; from the "
        f"repository's root: pip install {pip_args}"
        for command, (distribution, pip_args) in OPTIONAL_COMMANDS.items()
    }
    for entry in metadata.entry_points(group=COMMANDS_GROUP):
        if entry.name in sub.choices:
            continue  # two installs of one distribution: the first wins, as for imports
        try:
            add_parser = entry.load()
        except ImportError as exc:  # a broken install must not stop `tensorserve serve`
            if entry.name in OPTIONAL_COMMANDS:
                distribution, pip_args = OPTIONAL_COMMANDS[entry.name]
                fix = f"from the repository's root: pip install --force-reinstall {pip_args}"
            else:  # a third party's command: its own package says how to install it
                distribution = entry.dist.name if entry.dist is not None else "its package"
                fix = f"reinstall {distribution}"
            missing[entry.name] = f"tensorserve {entry.name} could not be loaded ({exc}); {fix}"
            continue
        add_parser(sub)
        missing.pop(entry.name, None)
    for command, reason in missing.items():
        # Listed by --help all the same; main() answers it before parsing.
        sub.add_parser(command, help=f"(not installed) {reason}", add_help=False)
    return missing


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = OneLineErrors(prog="tensorserve", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"tensorserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineErrors)
    serve_parser = add_serve_parser(sub)
    from tensorserve.top import add_parser as add_top_parser

    add_top_parser(sub)
    missing = add_installed_commands(sub)
    if argv and argv[0] in missing:
        print(missing[argv[0]], file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    if args.command == "serve":
        try:
            settings = settings_from_args(args)
        except ValidationError as exc:
            serve_parser.error(_settings_error(exc))
        return serve(settings)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
