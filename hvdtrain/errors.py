"""The two ways a command ends badly, as the user sees them."""

from __future__ import annotations

import click

EXIT_USAGE = 2


class UserError(click.ClickException):
    """Bad input: one line, exit 2, no traceback."""

    exit_code = EXIT_USAGE

    def show(self, file=None) -> None:
        click.echo(f"hvdtrain: error: {self.format_message()}", err=True)


class JobFailed(click.ClickException):
    """The job ran and failed (or was stopped): what happened, where its logs are."""

    exit_code = 1

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code

    def show(self, file=None) -> None:
        click.echo(f"hvdtrain: {self.format_message()}", err=True)
