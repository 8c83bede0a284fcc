"""How a budget is split: across precision tiers (``tiers``: byte-capped tier choice per token)."""
