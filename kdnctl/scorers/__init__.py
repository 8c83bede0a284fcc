"""Query-agnostic token scorers: each ranks a document's tokens for the presses."""
