"""Precision: one policy (param / compute / reduce dtypes) for every layout, fp8 (torchao) and
int8 training of the linears with a roofline filter, and the hardware peaks MFU is measured against."""
from common.precision.policy import DTYPES, PrecisionPolicy, default_policy, resolve_policy

__all__ = ["DTYPES", "PrecisionPolicy", "default_policy", "resolve_policy"]
