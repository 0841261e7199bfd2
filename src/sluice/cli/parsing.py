"""Negative numbers on the command line are arguments, not options.

click reads ``sluice budget top-up team -100`` as the options ``-1 -0 -0``
and answers "No such option: -1", so the command never gets to say what is
wrong with the number. :class:`SluiceCommand` parses a token that is a
number with a minus sign as an argument, as argparse does when no option
looks like a number (none of ours does); the command then checks its range
and says what to do instead. Values of options (``--priority -3``) were
always read as values.

Typer vendors click since 0.26 (``typer._click``); its parser class is the
one private name this module relies on, and tests/cli/test_cli_budget.py fails
if a new typer changes it.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from typer._click.parser import _OptionParser
from typer.core import TyperCommand

if TYPE_CHECKING:
    from typer._click.core import Context
    from typer._click.parser import _ParsingState

_NEGATIVE_NUMBER = re.compile(r"-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


class _NumbersAreArguments(_OptionParser):
    def _process_opts(self, arg: str, state: _ParsingState) -> None:
        if _NEGATIVE_NUMBER.fullmatch(arg):
            state.largs.append(arg)
        else:
            super()._process_opts(arg, state)


class SluiceCommand(TyperCommand):
    """A typer command whose negative-number arguments reach the command."""

    def make_parser(self, ctx: Context) -> _OptionParser:
        parser = _NumbersAreArguments(ctx)
        for param in self.get_params(ctx):
            param.add_to_parser(parser, ctx)
        return parser
