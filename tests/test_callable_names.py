"""Stage code names every callable its graph calls by an import; one that no import reaches is
refused with why and how to make it importable (fxpipe.callable_names)."""
from __future__ import annotations

import pytest
import torch

from fxpipe.callable_names import callable_name
from fxpipe.errors import CodegenError


def scale(x: torch.Tensor) -> torch.Tensor:
    return 2 * x


def _name(target: object) -> tuple[str, set[str]]:
    imports: set[str] = set()
    return callable_name(target, "node", imports, set()), imports


def test_torch_builtins_and_module_level_functions_are_named_by_their_import():
    assert _name(torch.nn.functional.relu)[0] == "torch.nn.functional.relu"
    assert _name(len)[0] == "len"
    assert _name(scale) == ("test_callable_names.scale", {"test_callable_names"})


def _in_main() -> object:
    def defined_in_script(x: torch.Tensor) -> torch.Tensor:
        return x
    defined_in_script.__module__ = "__main__"
    defined_in_script.__qualname__ = "defined_in_script"
    return defined_in_script


def _local() -> object:
    def inner(x: torch.Tensor) -> torch.Tensor:
        return x
    return inner


@pytest.mark.parametrize("target, hint", [
    (_in_main(), "defined in the script run as __main__"),
    (lambda x: x, "give it a name"),
    (_local(), "not inside a function"),
])
def test_a_callable_no_import_reaches_is_refused_saying_why(target, hint):
    with pytest.raises(CodegenError, match="cannot be imported by name") as error:
        _name(target)
    assert hint in error.value.hint
