"""Shared by the fp8 and int8 conversions: which linears to convert, and a report of why.

The roofline (common.precision.roofline) needs each linear's row count M, which depends on the
batch and sequence length the model trains with, not on the module. `record_linear_rows` runs one
probe forward at the training shapes and records M per linear; `module_filter` turns those rows
into a `(module, fqn) -> bool` filter (torchao's module_filter_fn signature) that records each
decision in a LowPrecisionReport.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch
from torch import nn

from common.precision.hardware import DeviceSpec
from common.precision.roofline import ALIGNMENT, resolve_spec, should_convert

MODE_LABELS = {"tensorwise": "fp8 tensorwise", "rowwise": "fp8 rowwise", "int8": "int8"}
NOT_RUN = "not run in the probe forward"


def record_linear_rows(model: nn.Module, run_forward: Callable[[], object]) -> dict[str, int]:
    """Module name -> M (product of all input dims but the last) of every nn.Linear that
    `run_forward()` calls; the maximum over calls when a linear runs several times."""
    rows: dict[str, int] = {}
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            def hook(mod, args, name=name):
                m = math.prod(args[0].shape[:-1])
                rows[name] = max(rows.get(name, 0), m)
            handles.append(module.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            run_forward()
    finally:
        for h in handles:
            h.remove()
    return rows


@dataclass
class LowPrecisionReport:
    mode: str  # "tensorwise" | "rowwise" | "int8"
    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # fqn -> reason ("<category>: <detail>")

    def summary(self) -> str:
        """e.g. 'fp8 rowwise: 48 of 74 linears converted (26 kept: 24 predicted slower, 2 K/N not
        multiple of 16)'."""
        total = len(self.converted) + len(self.skipped)
        text = f"{MODE_LABELS.get(self.mode, self.mode)}: {len(self.converted)} of {total} linears converted"
        if self.skipped:
            counts = Counter(reason.split(":")[0] for reason in self.skipped.values())
            kept = ", ".join(f"{n} {category}" for category, n in counts.most_common())
            text += f" ({len(self.skipped)} kept: {kept})"
        return text


@dataclass
class LinearFilter:
    """torchao-style module filter: True converts the linear; every decision lands in `report`."""
    rows: Mapping[str, int]
    spec: DeviceSpec
    report: LowPrecisionReport
    exclude: tuple[str, ...] = ()
    force: bool = False

    def _excluded(self, fqn: str) -> str | None:
        return next((p for p in self.exclude if fqn == p or fqn.endswith("." + p)), None)

    def decide(self, module: nn.Linear, fqn: str) -> tuple[bool, str]:
        k, n = module.in_features, module.out_features
        pattern = self._excluded(fqn)
        if pattern is not None:
            return False, f"excluded: matches {pattern!r}"
        if self.force:  # skip the roofline, keep the kernels' alignment rule
            if k % ALIGNMENT or n % ALIGNMENT:
                return False, f"K/N not multiple of {ALIGNMENT}: K={k}, N={n}"
            return True, "forced"
        if fqn not in self.rows:
            return False, NOT_RUN
        return should_convert(self.rows[fqn], k, n, self.report.mode, self.spec)

    def __call__(self, module: nn.Module, fqn: str) -> bool:
        if type(module) is not nn.Linear:  # already converted, or a subclass with its own forward
            ok, reason = False, f"not a plain nn.Linear: {type(module).__name__}"
        else:
            ok, reason = self.decide(module, fqn)
        if ok:
            self.report.converted.append(fqn)
        else:
            self.report.skipped[fqn] = reason
        return ok


def module_filter(rows: Mapping[str, int], mode: str, spec: DeviceSpec | None = None,
                  exclude: tuple[str, ...] = (), *, force: bool = False,
                  device: torch.device | None = None) -> LinearFilter:
    """A `(module, fqn) -> bool` filter for `mode`; its decisions accumulate in `.report`.
    spec None: the table entry of `device` if it is a known GPU, else the H100 default
    (roofline.resolve_spec). `exclude` names linears (full name or a dotted suffix, e.g.
    "final.linear") kept in high precision regardless; `force` converts every aligned linear
    (numerics tests, CPU runs)."""
    return LinearFilter(dict(rows), resolve_spec(spec, device), LowPrecisionReport(mode), tuple(exclude), force)


def model_device(model: nn.Module) -> torch.device | None:
    return next((p.device for p in model.parameters()), None)


def swap_linears(model: nn.Module, keep: LinearFilter, make: Callable[[nn.Linear], nn.Module]) -> None:
    """Replace, in place, each nn.Linear that `keep` accepts by `make(linear)`; `keep` sees the
    named_modules() names, as record_linear_rows does."""
    for fqn, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            child_fqn = f"{fqn}.{child_name}" if fqn else child_name
            if isinstance(child, nn.Linear) and keep(child, child_fqn):
                setattr(module, child_name, make(child))
