"""Pipeline options (``--pipeline-options``, a JSON object) checked against the
types a pipeline's constructor declares, before it runs: a wrong type is
refused naming the option, not met later as a tensor's or a comparison's
error deep in the build."""

from __future__ import annotations

import typing
from collections.abc import Callable, Iterable
from typing import Any

import msgspec


def check_option_types(
    constructor: Callable[..., Any],
    options: dict[str, Any],
    not_options: Iterable[str],
    named_choices: Iterable[str] = (),
) -> None:
    """``ValueError`` naming an option of ``options`` whose value is not of the type
    ``constructor`` declares for it (JSON's ``9.0`` for an integer, ``"16"`` for
    a number, ``1`` for a boolean: checked strictly, an integer passing for a
    number), or one of ``not_options`` (arguments the factory gives itself). An
    option it does not declare is left to the constructor, which refuses it
    (``rtvideo.workers.pipelines.build_pipeline`` names it), and so are
    ``named_choices``: options the constructor refuses naming the values it
    takes, a better message than a type's."""
    hints = typing.get_type_hints(constructor)
    for option, value in options.items():
        if option in not_options:
            raise ValueError(f"pipeline option {option}: set by the model's preset or directory, not an option")
        if option in hints and option not in named_choices:
            try:
                msgspec.convert(value, type=hints[option], strict=True)
            except msgspec.ValidationError as error:
                raise ValueError(f"pipeline option {option}: {error} ({value!r})") from None
