"""Small helpers on Beam command-line argument lists (``["--flag=value", "--flag", "value"]``).

Every runner module adds its defaults with :func:`with_defaults`: a flag the user gave, in
either spelling, always wins. :func:`take` removes one of our own flags (not Beam's) from
the list and returns its value.

Why a list and not Beam's option classes: a list of flags is what ``PipelineOptions(flags)``
takes, and the user's flags reach Beam exactly as given, including flags of runners or IOs
no option class here knows. And the runners must know which flags the user *gave*: a view
(``PipelineOptions(args).view_as(FlinkRunnerOptions)``) fills Beam's defaults in
(``flink_version`` reads as the newest published Flink when none was given), so it cannot
tell a choice from a default. Where Beam's objects need the options (the Flink job server,
Dataflow's job description) they are built from this list with ``PipelineOptions`` and
read through ``view_as``. Reading a flag here imports no Beam: the local runner's driver
plans while a warm process imports it (:mod:`.warm_workers`).
"""
from __future__ import annotations


class RunnerOptionsError(ValueError):
    """A runner flag that cannot be used; the message names the flag and the fix."""


def has(args: list[str], flag: str) -> bool:
    """Whether ``flag`` appears as ``--flag`` or ``--flag=value``."""
    return any(a == flag or a.startswith(flag + "=") for a in args)


def value(args: list[str], flag: str) -> str | None:
    """The last value given for ``flag`` (``--flag=v`` or ``--flag v``), or None."""
    found = None
    for i, a in enumerate(args):
        if a.startswith(flag + "="):
            found = a.split("=", 1)[1]
        elif a == flag and i + 1 < len(args) and not args[i + 1].startswith("--"):
            found = args[i + 1]
    return found


def values(args: list[str], flag: str) -> list[str]:
    """Every value given for a repeatable flag such as ``--experiments``."""
    out = []
    for i, a in enumerate(args):
        if a.startswith(flag + "="):
            out.append(a.split("=", 1)[1])
        elif a == flag and i + 1 < len(args) and not args[i + 1].startswith("--"):
            out.append(args[i + 1])
    return out


def take(args: list[str], flag: str) -> tuple[list[str], str | None]:
    """(args without ``flag``, its value or None). Raises when ``--flag`` has no value."""
    rest: list[str] = []
    found = None
    i = 0
    while i < len(args):
        a = args[i]
        if a.startswith(flag + "="):
            found = a.split("=", 1)[1]
        elif a == flag:
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                raise RunnerOptionsError(f"{flag} needs a value")
            found = args[i + 1]
            i += 1
        else:
            rest.append(a)
        i += 1
    return rest, found


def with_defaults(args: list[str], defaults: dict[str, str]) -> list[str]:
    """``args`` followed by ``--k=v`` for every default the user did not give."""
    return args + [f"{k}={v}" for k, v in defaults.items() if not has(args, k)]


def docker_image_config(args: list[str]) -> list[str]:
    """For a portable job (Flink, a job server) in a DOCKER environment: Beam takes the
    worker image from ``--environment_config`` and ignores ``--sdk_container_image`` (a
    Dataflow flag). Accept the Dataflow spelling: ``[--environment_config=IMAGE]`` when
    only ``--sdk_container_image=IMAGE`` was given, else ``[]``."""
    env = (value(args, "--environment_type") or "DOCKER").upper()
    image = value(args, "--sdk_container_image")
    if env == "DOCKER" and image and not has(args, "--environment_config"):
        return [f"--environment_config={image}"]
    return []
