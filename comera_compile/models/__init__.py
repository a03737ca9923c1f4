"""Reference models used by examples, tests and benchmarks."""

from comera_compile.models.six_encoder import (
    SixEncoderClassifier,
    SixEncoderConfig,
    reference_tensorized,
)

__all__ = ["SixEncoderClassifier", "SixEncoderConfig", "reference_tensorized"]
