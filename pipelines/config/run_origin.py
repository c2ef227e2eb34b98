"""What a run was asked to do, kept with its results: the command line and its ``--set`` overrides.

A run folder's ``config.yaml`` is the resolved scenario (absolute output folder, resolved precision) under a header
of YAML comments: the code version, the precision, the command and the overrides, so the file says what ran and
``compat run <folder>/config.yaml`` runs the same stages into the same folder (comments are not read back). Every
invocation's record (``executions/*.json``) holds the same facts as data. Credentials in URIs are redacted.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Iterable

from pipelines.config.redaction import redact_uri


@dataclass(frozen=True)
class RunOrigin:
    """The command line of a run (``compat <arguments>``, or how a library caller names itself) and its overrides."""

    command: tuple[str, ...] = ()
    overrides: tuple[str, ...] = ()

    @classmethod
    def of_command(cls, arguments: Iterable[str], overrides: Iterable[str] = ()) -> "RunOrigin":
        """The origin of ``compat ARGUMENTS`` (the arguments after the program name)."""
        return cls(tuple(redact_uri(item) for item in ("compat", *arguments)),
                   tuple(redact_uri(item) for item in overrides))

    def as_json(self) -> dict:
        return {"command": shlex.join(self.command) if self.command else None, "overrides": list(self.overrides)}


def config_header(origin: RunOrigin | None, code_version: str, precision: str, output: str) -> str:
    """The comment lines config.yaml starts with (each ending in a newline)."""
    origin = origin or RunOrigin()
    lines = [
        "# The resolved scenario of this run folder. `compat run <this file>` runs the same stages (same keys) into",
        "# the same folder; these comment lines are a record, not read back.",
        f"# output: {output}",
        f"# code version: {code_version}",
        f"# precision: {precision} (training.autocast as resolved for this run)",
        f"# command: {shlex.join(origin.command) if origin.command else '(not run from the command line)'}",
        f"# overrides: {' '.join(shlex.quote(item) for item in origin.overrides) or '(none)'}",
    ]
    return "\n".join(lines) + "\n"


__all__ = ["RunOrigin", "config_header"]
