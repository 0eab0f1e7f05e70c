"""What every command shares: hvdtrain's errors as the user sees them."""

from __future__ import annotations

import sys

import click

from hvdtrain.errors import UserError


class Commands(click.Group):
    """hvdtrain's errors as the user sees them: one line on stderr, no traceback."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except UserError as error:
            click.echo(f"hvdtrain: error: {error}", err=True)
            ctx.exit(error.exit_code)


def fail(message: str, exit_code: int = 1) -> None:
    """A command that ran and failed: what happened, and the exit code."""
    click.echo(f"hvdtrain: {message}", err=True)
    sys.exit(exit_code)
