"""Where float16 and float8 lose the gradients: exact per-tensor statistics of a cast.

Framework-neutral (NumPy and lossscale's core only; matplotlib for the heatmap, imported
when drawn). The front ends feed it: ``lossscale.torch.NumericsMonitor``,
``lossscale.jax.gradient_counts`` and ``lossscale.keras.NumericsCallback``.
"""

from lossscale.numerics._counts import TensorStats
from lossscale.numerics._formats import FloatFormat, float_format, formats, register_format
from lossscale.numerics._plot import heatmap
from lossscale.numerics._recommend import Recommendation, ScaleRange, recommend
from lossscale.numerics._report import Exponents, Report, ReportRow, format_scale
from lossscale.numerics._stats import tensor_stats

__all__ = [
    "Exponents",
    "FloatFormat",
    "Recommendation",
    "Report",
    "ReportRow",
    "ScaleRange",
    "TensorStats",
    "float_format",
    "format_scale",
    "formats",
    "heatmap",
    "recommend",
    "register_format",
    "tensor_stats",
]
