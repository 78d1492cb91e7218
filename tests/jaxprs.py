"""Counting equations in jaxprs, nested ones included."""

from jax.extend.core import jaxprs_in_params


def count_eqns(jaxpr, matches) -> int:
    """The equations of `jaxpr`, and of every jaxpr nested in them, for which `matches(eqn)` holds."""
    return sum(count_eqns(getattr(sub, "jaxpr", sub), matches) for eqn in jaxpr.eqns
               for sub in jaxprs_in_params(eqn.params)) + sum(bool(matches(eqn)) for eqn in jaxpr.eqns)
