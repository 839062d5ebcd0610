"""This device's roofs for a serving study: the copy kernel's bandwidth, a read stream's
(what a decode step mostly does) and the matmul peak, measured in the same process before the
sweep; the two bandwidths measured again after it (`measure_again`: on a shared host they
move from minute to minute, 55.65 to 94.14 GB/s within one run on a 2-core VM, so one figure
taken before would hold every point against whatever the host gave at that moment); and the
memory roof raised to the best bandwidth measured, a decode step's included (as the ledger
defines it)."""

import dataclasses

from lab.measure import ceilings
from lab.measure.serving import DecodePoint, Roofs


def measure_roofs(dtype: str, *, budget_s: float, size: str = "quick") -> Roofs:
    sz = ceilings.sizes(ceilings.backend(), size)
    copy = ceilings.copy_bandwidth(sz["copy"], budget_s=budget_s)
    read = ceilings.read_bandwidth(sz["copy"], budget_s=budget_s)
    peak = ceilings.measure_matmul(dtype, n=sz["mm_n"], budget_s=budget_s)["flops_per_s"]
    return Roofs(copy["bytes_per_s"], peak, dtype, copy, read=read, peak_n=sz["mm_n"])


def measure_again(roofs: Roofs, *, budget_s: float, size: str = "quick") -> Roofs:
    """`roofs` with the copy and the read stream measured again (after the sweep) and the
    memory roof the better of the two copies."""
    sz = ceilings.sizes(ceilings.backend(), size)
    copy = ceilings.copy_bandwidth(sz["copy"], budget_s=budget_s)
    read = ceilings.read_bandwidth(sz["copy"], budget_s=budget_s)
    if copy["bytes_per_s"] <= roofs.bandwidth:
        return dataclasses.replace(roofs, copy_after=copy, read_after=read)
    return dataclasses.replace(
        roofs,
        bandwidth=copy["bytes_per_s"],
        how="the copy kernel (x ← x·s), measured after the sweep",
        copy_after=copy,
        read_after=read,
    )


def best_roofs(roofs: Roofs, points: list[DecodePoint]) -> Roofs:
    """The memory roof as the best bandwidth measured, as the ledger defines it
    (ceilings.memory_roof): a decode step that moved bytes faster than the copy kernel raises
    the roof to its own rate (`against` then takes every point's share against it, so no
    point sits above its roof)."""
    rates: dict[str, float] = {}
    for p in points:  # float and int8 steps share batch sizes: the best rate under each name
        name = f"decode at batch {p.batch}" + (" (int8)" if p.int8_weights else "")
        rates[name] = max(rates.get(name, 0.0), p.bytes_per_s)
    bandwidth, how = ceilings.memory_roof(roofs.bandwidth, rates)
    if how is None:
        return roofs
    return dataclasses.replace(roofs, bandwidth=bandwidth, how=how)


def against(points, roofs: Roofs) -> tuple[DecodePoint, ...]:
    """`points` with their memory roof share taken against `roofs`."""
    return tuple(dataclasses.replace(p, roof_bandwidth=roofs.bandwidth) for p in points)
