"""Ingest: documents -> prefill -> chunk bundles -> store.

``prefix`` stores one sequence per document (chunks keyed by a prefix hash chain);
``independent`` stores composable chunks prefilled on their own (keyed by content hash).
"""

from .prefix import IngestOptions, IngestReport, doc_version_for, ingest_documents

__all__ = ["IngestOptions", "IngestReport", "doc_version_for", "ingest_documents"]
