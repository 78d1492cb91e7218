"""The part of a device a run may use, from JAX's allocator variables, and the plan's verdict against it."""

import pytest

from finetune.planning.plan import TEMPORARIES_MARGIN, PlanReport
from finetune.planning.allocator import AllocatorSettingError, UsableMemory, fraction_to_fit, usable_memory

GB = 1e9


@pytest.mark.parametrize("env, fraction", [
    ({}, 0.75),  # JAX's default preallocation
    ({"XLA_CLIENT_MEM_FRACTION": "0.5"}, 0.5),
    ({"XLA_CLIENT_MEM_FRACTION": "0.95"}, 0.95),
    ({"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"}, 0.9),  # the deprecated name alone still counts
    ({"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}, 0.75),  # grows on demand, up to the same limit
    ({"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "XLA_CLIENT_MEM_FRACTION": "0.95"}, 0.95),
    ({"XLA_PYTHON_CLIENT_ALLOCATOR": "bfc", "XLA_CLIENT_MEM_FRACTION": "0.8"}, 0.8),
    ({"XLA_PYTHON_CLIENT_ALLOCATOR": "vmm", "XLA_CLIENT_MEM_FRACTION": "0.8"}, 0.8),
    ({"XLA_PYTHON_CLIENT_ALLOCATOR": "platform", "XLA_CLIENT_MEM_FRACTION": "0.5"}, 1.0),  # no pool
    ({"XLA_PYTHON_CLIENT_ALLOCATOR": "cuda_async"}, 1.0),  # the fraction is a cache size, not a limit
])
def test_fraction_follows_the_allocator_variables(env, fraction):
    assert usable_memory(env).fraction == fraction


@pytest.mark.parametrize("env, message", [
    ({"XLA_CLIENT_MEM_FRACTION": "0.9", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"},
     "XLA_CLIENT_MEM_FRACTION and XLA_PYTHON_CLIENT_MEM_FRACTION are both set"),
    ({"XLA_CLIENT_MEM_FRACTION": "lots"}, "XLA_CLIENT_MEM_FRACTION='lots': expected a fraction"),
    ({"XLA_CLIENT_MEM_FRACTION": "1.5"}, "XLA_CLIENT_MEM_FRACTION='1.5': expected a fraction"),
    ({"XLA_PYTHON_CLIENT_MEM_FRACTION": "0"}, "XLA_PYTHON_CLIENT_MEM_FRACTION='0': expected a fraction"),
    ({"XLA_CLIENT_MEM_FRACTION": "nan"}, "XLA_CLIENT_MEM_FRACTION='nan': expected a fraction"),
    ({"XLA_PYTHON_CLIENT_ALLOCATOR": "arena"}, "XLA_PYTHON_CLIENT_ALLOCATOR='arena': expected one of default"),
    ({"XLA_PYTHON_CLIENT_PREALLOCATE": "maybe"}, "XLA_PYTHON_CLIENT_PREALLOCATE='maybe': expected true or false"),
])
def test_bad_allocator_variables_are_errors(env, message):
    with pytest.raises(AllocatorSettingError, match="^" + message.replace("(", r"\(")):
        usable_memory(env)


def test_fraction_to_fit_rounds_up_to_a_twentieth_and_stops_at_095():
    assert fraction_to_fit(150 * GB, 192 * GB) == 0.8  # 0.78 -> 0.80
    assert fraction_to_fit(0.85 * 192 * GB, 192 * GB) == 0.85  # exactly a twentieth stays
    assert fraction_to_fit(182.4 * GB, 192 * GB) == 0.95
    assert fraction_to_fit(183 * GB, 192 * GB) is None


def report(total_gb: float, fraction: float, reason: str = "test") -> PlanReport:
    """A plan whose total (with its margin) is `total_gb`, judged on a 192 GB device."""
    temp = 10 * GB
    weights = total_gb * GB - temp * (1 + TEMPORARIES_MARGIN)
    return PlanReport(mesh={"fsdp": 8}, backend="cpu", weights=weights, lora_and_optimizer=0.0, batch=0.0, temp=temp,
                      compile_seconds=1.0, hbm=192 * GB, usable=UsableMemory(fraction, reason), lines=[])


def test_the_verdict_is_judged_against_the_usable_part():
    # 155 GB: fits a whole MI300X, not JAX's default 75% (144 GB).
    default = report(155, 0.75, "JAX's default preallocation")
    assert not default.fits
    text = str(default)
    assert "usable: 192 GB x 0.75 = 144.0 GB per device (JAX's default preallocation)" in text
    assert "DOES NOT FIT in 144.0 GB per device (108% used, 11.0 GB missing); fits at XLA_CLIENT_MEM_FRACTION=0.85" in text
    high = report(155, 0.95)
    assert high.fits and "fits in 182.4 GB per device (85% used, 27.4 GB to spare)" in str(high)
    assert "DOES NOT FIT in 96.0 GB" in str(report(155, 0.5))
    # Beyond 0.95 no fraction is suggested.
    assert str(report(185, 0.75)).endswith("DOES NOT FIT in 144.0 GB per device (128% used, 41.0 GB missing)")


def test_the_total_carries_the_measured_margin_beside_the_compilers_figure():
    plan = report(100, 0.75)
    assert plan.margin == pytest.approx(10 * GB * TEMPORARIES_MARGIN)
    assert plan.total == pytest.approx(plan.compiler_total + plan.margin)
    lines = str(plan).splitlines()
    margin = [line for line in lines if line.strip().startswith("margin")]
    assert margin == [f"  {f'margin ({TEMPORARIES_MARGIN:.0%} of temporaries, measured)':<40} "
                      f"{plan.margin / GB:10.2f} GB"]
    total = [line for line in lines if line.strip().startswith("total")]
    assert total == [f"  {'total':<40} {100:10.2f} GB  (compiler's figure {plan.compiler_total / GB:.2f} GB)"]
