"""The one place that knows architectures: see :mod:`kdnctl.models.adapter`."""

from .adapter import (FULL, SLIDING, LayerAttention, ModelAdapter, adapter_for, check_supported,
                      plain_rope_theta)

__all__ = ["FULL", "SLIDING", "LayerAttention", "ModelAdapter", "adapter_for", "check_supported", "plain_rope_theta"]
