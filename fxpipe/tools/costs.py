"""`fxpipe costs`: every node's predicted cost, from a model factory, as a table."""
from __future__ import annotations

import sys
from collections.abc import Sequence

from fxpipe import ir
from fxpipe.costs import cost_table
from fxpipe.frontend.capture import capture
from fxpipe.models import load_factory
from fxpipe.passes.cost import annotate_costs
from fxpipe.profile import get_profile


def print_costs(factory: str, settings: Sequence[str], *, modules: bool = False,
                microbatch: int | None = None, profile: str | None = None,
                sort: str | None = None, by_module: bool = False, top: int | None = None) -> int:
    """Captures the factory's model (its leaf modules kept whole with `modules`), costs every
    node and prints the table at `microbatch` samples (default: the example's batch)."""
    model, inputs, kwargs, _ = load_factory(factory, list(settings))
    print(f"capturing {type(model).__name__} and costing every node ...", file=sys.stderr,
          flush=True)
    gm = capture(model, inputs, kwargs, inline_modules=not modules)
    annotate_costs(gm)
    b = microbatch or gm.meta[ir.CAPTURE].batch_size
    sort = sort or ("time" if top else None)  # top N: the costliest N
    print(cost_table(gm, b=b, profile=get_profile(profile), sort=sort, by_module=by_module,
                     top=top))
    return 0
